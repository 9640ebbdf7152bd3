// One decode step of a Hugging Face decoder for one new token per sequence, the whole
// model in one call: embedding row (+ a learned position row), every layer, final norm,
// LM head. The layers are the pre-norm decoders and their variants: LLaMA, Mistral,
// Qwen2/3, Phi-3 (RMSNorm, rotary positions, grouped-query attention, a SiLU-gated MLP),
// OLMo 2 (no pre-norms: norms after attention and MLP, before the residual add; full-width
// q/k norms), Gemma 2 / 3 (pre- and post-norms, a scaled embedding, a GELU-gated MLP,
// soft-capped attention logits and final logits, Gemma 3's local and global rotary
// tables) and GPT-2 (LayerNorm with biases, learned positions, a GELU MLP). Every
// projection is a `ChainLinear`: a sum of chains of bound weights (`BoundRows`: a dense
// weight, or an algebra layer's typed copies, each reading its type from the step's type
// table), so plain, converted (`convert_`) and compressed (low-rank, shared-basis) models
// run the same code. Replaces the ~40 Python-dispatched ops per layer of a Hugging Face
// decode step. The reference is the model's own forward; tests compare the two
// (structlm.hf.fused_decode).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "dot.h"
#include "norms.h"
#include "rows_kernel.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

using structlm::BoundRows;
using structlm::layer_norm_rows;
using structlm::rms_norm_rows;

// y = sum over terms of chain(x) (+ bias): each chain applies its weights in order
// (chain[0] first); the bias is fused into the first term's last product.
class ChainLinear {
 public:
  ChainLinear(std::vector<std::vector<BoundRows>> terms, c10::optional<at::Tensor> bias)
      : terms_(std::move(terms)), bias_(std::move(bias)) {
    TORCH_CHECK(!terms_.empty(), "ChainLinear: at least one term expected");
    for (const auto& chain : terms_) {
      TORCH_CHECK(!chain.empty(), "ChainLinear: an empty chain");
      for (size_t i = 1; i < chain.size(); ++i) {
        TORCH_CHECK(chain[i].in_features() == chain[i - 1].out_features(), "ChainLinear: ",
                    chain[i - 1].out_features(), " outputs feed ", chain[i].in_features(),
                    " inputs");
      }
    }
    in_ = terms_[0].front().in_features();
    out_ = terms_[0].back().out_features();
    for (const auto& chain : terms_) {
      TORCH_CHECK(chain.front().in_features() == in_ && chain.back().out_features() == out_,
                  "ChainLinear: every term must map ", in_, " to ", out_, " features");
    }
    if (bias_.has_value()) {
      TORCH_CHECK(bias_->is_contiguous() && bias_->numel() == out_ &&
                      bias_->scalar_type() == terms_[0][0].typed().scalar_type(),
                  "ChainLinear: a contiguous bias of ", out_, " elements expected");
    }
  }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  int64_t max_slot() const {
    int64_t s = -1;
    for (const auto& chain : terms_) {
      for (const auto& w : chain) s = std::max(s, w.slot());
    }
    return s;
  }
  at::ScalarType dtype() const { return terms_[0][0].typed().scalar_type(); }

  // Every type the step's table (capacity, slots) gives a weight is one it has.
  void check_types(const at::Tensor& table, const char* what) const {
    const int64_t rows = table.size(0), slots = table.size(1);
    const int64_t* t = table.data_ptr<int64_t>();
    for (const auto& chain : terms_) {
      for (const auto& w : chain) {
        if (w.slot() < 0) continue;
        for (int64_t p = 0; p < rows; ++p) {
          const int64_t a = t[p * slots + w.slot()];
          TORCH_CHECK(a >= 0 && a < w.n_types(), "DecodeStack: ", what, ": position ", p,
                      " has type ", a, " but the weight has ", w.n_types(), " types");
        }
      }
    }
  }

  // x (M, in) contiguous -> (M, out); types: the step's type table row.
  at::Tensor forward(const at::Tensor& x, const int64_t* types) const {
    at::Tensor y;
    for (size_t t = 0; t < terms_.size(); ++t) {
      at::Tensor h = x;
      const auto& chain = terms_[t];
      for (size_t i = 0; i < chain.size(); ++i) {
        const BoundRows& w = chain[i];
        const int64_t type = w.slot() < 0 ? 0 : types[w.slot()];
        const bool fuse_bias = t == 0 && i + 1 == chain.size();
        h = w.forward(h, type, fuse_bias ? bias_ : c10::nullopt);
      }
      y = t == 0 ? h : y.add_(h);
    }
    return y;
  }

 private:
  std::vector<std::vector<BoundRows>> terms_;
  c10::optional<at::Tensor> bias_;
  int64_t in_ = 0, out_ = 0;
};

// One decoder layer's parameters. ln_1 / ln_2: the norms before attention and MLP (with
// biases for a LayerNorm; absent: none, OLMo 2); post_attn / post_mlp: norms of the
// attention and MLP outputs before the residual add (OLMo 2) or absent. attn_in: [q, k, v]
// or one stacked [q; k; v]; mlp_in: [gate, up] or one stacked [gate; up] (gated), or [fc];
// q_norm / k_norm: RMSNorm weights after the projections, per head (head_dim: Qwen3) or
// over the full width (OLMo 2), or absent. scaling: the attention logits' factor.
struct DecoderLayer {
  c10::optional<at::Tensor> ln_1, ln_1_bias, ln_2, ln_2_bias, post_attn, post_mlp;
  std::vector<ChainLinear> attn_in;
  std::vector<ChainLinear> o;  // one
  std::vector<ChainLinear> mlp_in;
  std::vector<ChainLinear> down;  // one
  c10::optional<at::Tensor> q_norm, k_norm;
  double scaling = 1.0;
  int64_t rope = 0;  // which of the stack's rotary tables (Gemma 3: local or global)
};

enum class Activation { kSilu, kGeluTanh, kGelu };

template <typename T>
inline T activate(T v, Activation act) {
  switch (act) {
    case Activation::kSilu:
      return v / (T(1) + std::exp(-v));
    case Activation::kGeluTanh: {
      const T c = static_cast<T>(0.7978845608028654);  // sqrt(2 / pi)
      return T(0.5) * v * (T(1) + std::tanh(c * (v + T(0.044715) * v * v * v)));
    }
    default:
      return T(0.5) * v * (T(1) + std::erf(v * static_cast<T>(0.7071067811865476)));
  }
}

// HF's rotate-half rotary embedding, in place, on the first `rot` dims of each of `heads`
// vectors of width hd: x1 = v[:rot/2], x2 = v[rot/2:rot];
// v[:rot] = [x1 cos1 - x2 sin1, x2 cos2 + x1 sin2] with cos, sin (rot,) at this position.
template <typename T>
void rope(T* v, int64_t heads, int64_t hd, int64_t rot, const T* cos, const T* sin) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* p = v + h * hd;
    for (int64_t i = 0; i < half; ++i) {
      const T x1 = p[i], x2 = p[i + half];
      p[i] = x1 * cos[i] - x2 * sin[i];
      p[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
    }
  }
}

}  // namespace

// The whole model's decode step, caches owned. Construction fixes the parameters; `reset`
// sizes the caches for a batch; `set_cache` loads a prefill's keys and values; `step`
// decodes one token per sequence at position `pos` (all sequences unpadded, equal length).
class DecodeStack {
 public:
  DecodeStack(at::Tensor embed, double embed_scale, c10::optional<at::Tensor> pos_embed,
              std::vector<DecoderLayer> layers, at::Tensor final_norm,
              c10::optional<at::Tensor> final_norm_bias, ChainLinear head, double eps,
              bool layer_norm, int64_t n_heads, int64_t n_kv, int64_t head_dim,
              const std::string& act, bool gated, double attn_softcap, double final_softcap,
              std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, at::Tensor types)
      : embed_(std::move(embed)), embed_scale_(embed_scale), pos_embed_(std::move(pos_embed)),
        layers_(std::move(layers)), final_norm_(std::move(final_norm)),
        final_norm_bias_(std::move(final_norm_bias)), head_(std::move(head)), eps_(eps),
        layer_norm_(layer_norm), n_heads_(n_heads), n_kv_(n_kv), hd_(head_dim),
        gated_(gated), attn_softcap_(attn_softcap), final_softcap_(final_softcap),
        cos_(std::move(cos)), sin_(std::move(sin)), types_(std::move(types)) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.is_contiguous(), "DecodeStack: embedding "
                "(V, D) contiguous expected");
    D_ = embed_.size(1);
    const auto dt = embed_.scalar_type();
    if (act == "silu") {
      act_ = Activation::kSilu;
    } else if (act == "gelu_tanh") {
      act_ = Activation::kGeluTanh;
    } else {
      TORCH_CHECK(act == "gelu", "DecodeStack: activation ", act, ": expected silu, gelu_tanh "
                  "or gelu");
      act_ = Activation::kGelu;
    }
    TORCH_CHECK(n_heads_ > 0 && n_kv_ > 0 && n_heads_ % n_kv_ == 0, "DecodeStack: ",
                n_heads_, " query heads cannot share ", n_kv_, " key/value heads");
    TORCH_CHECK(!cos_.empty() && cos_.size() == sin_.size(), "DecodeStack: one or more "
                "pairs of rotary tables expected");
    cap_ = cos_[0].size(0);
    for (size_t i = 0; i < cos_.size(); ++i) {
      const auto& c = cos_[i];
      TORCH_CHECK(c.dim() == 2 && c.sizes() == sin_[i].sizes() && c.is_contiguous() &&
                      sin_[i].is_contiguous() && c.scalar_type() == dt &&
                      sin_[i].scalar_type() == dt && c.size(0) == cap_ && c.size(1) <= hd_ &&
                      c.size(1) % 2 == 0,
                  "DecodeStack: rotary tables (capacity, rot <= head_dim, even; rot = 0: "
                  "none) of the embedding's dtype expected, got ", c.sizes());
    }
    TORCH_CHECK(attn_softcap_ >= 0 && final_softcap_ >= 0, "DecodeStack: soft-caps must be "
                ">= 0 (0: none)");
    TORCH_CHECK(types_.dim() == 2 && types_.size(0) == cap_ &&
                    types_.scalar_type() == at::kLong && types_.is_contiguous(),
                "DecodeStack: a type table (", cap_, ", slots) int64 expected, got ",
                types_.sizes());
    if (pos_embed_.has_value()) {
      TORCH_CHECK(pos_embed_->dim() == 2 && pos_embed_->size(0) >= cap_ &&
                      pos_embed_->size(1) == D_ && pos_embed_->is_contiguous() &&
                      pos_embed_->scalar_type() == dt,
                  "DecodeStack: position embeddings (>= ", cap_, ", ", D_, ") expected, got ",
                  pos_embed_->sizes());
    }
    check_vector(final_norm_, "final norm", D_);
    check_vector(final_norm_bias_, "final norm bias", D_);
    check_linear(head_, D_, -1, "lm_head");
    const int64_t q_width = n_heads_ * hd_, kv_width = n_kv_ * hd_;
    for (const auto& L : layers_) {
      for (const auto* v : {&L.ln_1, &L.ln_1_bias, &L.ln_2, &L.ln_2_bias, &L.post_attn,
                            &L.post_mlp}) {
        check_vector(*v, "layer norm", D_);
      }
      TORCH_CHECK(L.o.size() == 1 && L.down.size() == 1, "DecodeStack: one o and one "
                  "down projection per layer expected");
      TORCH_CHECK(L.rope >= 0 && L.rope < static_cast<int64_t>(cos_.size()), "DecodeStack: "
                  "rotary table ", L.rope, " outside [0, ", cos_.size(), ")");
      if (L.attn_in.size() == 3) {
        check_linear(L.attn_in[0], D_, q_width, "q_proj");
        check_linear(L.attn_in[1], D_, kv_width, "k_proj");
        check_linear(L.attn_in[2], D_, kv_width, "v_proj");
      } else {
        TORCH_CHECK(L.attn_in.size() == 1, "DecodeStack: attention input: q, k, v or "
                    "one stacked projection expected");
        check_linear(L.attn_in[0], D_, q_width + 2 * kv_width, "qkv_proj");
      }
      check_linear(L.o[0], q_width, D_, "o_proj");
      const int64_t F = L.down[0].in_features();
      TORCH_CHECK(gated_ ? (L.mlp_in.size() == 1 || L.mlp_in.size() == 2)
                         : L.mlp_in.size() == 1,
                  "DecodeStack: MLP input: gate and up or one stacked projection (gated), "
                  "one projection (not gated) expected");
      for (const auto& lin : L.mlp_in) {
        check_linear(lin, D_, gated_ && L.mlp_in.size() == 1 ? 2 * F : F, "MLP input");
      }
      check_linear(L.down[0], F, D_, "down_proj");
      TORCH_CHECK(L.q_norm.has_value() == L.k_norm.has_value(),
                  "DecodeStack: q and k norms come together");
      if (L.q_norm.has_value()) {
        const bool per_head = L.q_norm->numel() == hd_ && L.k_norm->numel() == hd_;
        const bool full = L.q_norm->numel() == q_width && L.k_norm->numel() == kv_width;
        TORCH_CHECK(per_head || full, "DecodeStack: q/k norms of head_dim ", hd_,
                    " or of the full widths ", q_width, " / ", kv_width, " expected");
        check_vector(L.q_norm, "q norm", -1);
        check_vector(L.k_norm, "k norm", -1);
      }
    }
    reset(1);
  }

  int64_t capacity() const { return cap_; }
  int64_t n_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Empty caches for `batch` sequences: (batch, n_kv, capacity, head_dim) per layer.
  void reset(int64_t batch) {
    std::lock_guard<std::mutex> lock(mutex_);  // step runs without the GIL
    TORCH_CHECK(batch >= 1, "DecodeStack: batch ", batch, " must be >= 1");
    k_.clear();
    v_.clear();
    for (size_t i = 0; i < layers_.size(); ++i) {
      k_.push_back(at::empty({batch, n_kv_, cap_, hd_}, embed_.options()));
      v_.push_back(at::empty({batch, n_kv_, cap_, hd_}, embed_.options()));
    }
    batch_ = batch;
  }

  // Layer `layer`'s keys and values for positions 0 .. T - 1: (batch, n_kv, T, head_dim),
  // keys with the rotary embedding applied (as the Hugging Face caches hold them).
  void set_cache(int64_t layer, const at::Tensor& k, const at::Tensor& v) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(layer >= 0 && layer < n_layers(), "set_cache: layer ", layer, " outside [0, ",
                n_layers(), ")");
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == batch_ &&
                    k.size(1) == n_kv_ && k.size(3) == hd_ && k.size(2) <= cap_,
                "set_cache: keys/values (", batch_, ", ", n_kv_, ", T <= ", cap_, ", ", hd_,
                ") expected, got ", k.sizes(), " and ", v.sizes());
    k_[layer].narrow(2, 0, k.size(2)).copy_(k);
    v_[layer].narrow(2, 0, v.size(2)).copy_(v);
  }

  // Logits (batch, V) for token ids (batch,) at position `pos` (the caches hold 0..pos-1).
  at::Tensor step(const at::Tensor& ids, int64_t pos) {
    std::lock_guard<std::mutex> lock(mutex_);  // one step at a time per stack
    TORCH_CHECK(ids.dim() == 1 && ids.size(0) == batch_ && ids.scalar_type() == at::kLong,
                "step: ", batch_, " int64 token ids expected, got ", ids.sizes());
    TORCH_CHECK(pos >= 0 && pos < cap_, "step: position ", pos, " outside the capacity ",
                cap_);
    const int64_t V = embed_.size(0);
    const auto idc = ids.contiguous();
    const int64_t* id = idc.data_ptr<int64_t>();
    for (int64_t m = 0; m < batch_; ++m) {
      TORCH_CHECK(id[m] >= 0 && id[m] < V, "step: token id ", id[m], " outside [0, ", V, ")");
    }
    const int64_t* types = types_.data_ptr<int64_t>() + pos * types_.size(1);
    at::Tensor x = embed_.index_select(0, idc);  // (M, D)
    if (embed_scale_ != 1.0) {  // in the embedding's dtype, as the models scale it
      x.mul_(at::scalar_tensor(embed_scale_, x.options()));
    }
    if (pos_embed_.has_value()) x.add_(pos_embed_->select(0, pos));
    at::Tensor h = at::empty_like(x);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const DecoderLayer& L = layers_[l];
      const at::Tensor& a_in = norm_or_self(x, L.ln_1, L.ln_1_bias, h);
      at::Tensor q, k, v;  // (M, H hd), (M, KV hd) x 2, contiguous
      if (L.attn_in.size() == 3) {
        q = L.attn_in[0].forward(a_in, types);
        k = L.attn_in[1].forward(a_in, types);
        v = L.attn_in[2].forward(a_in, types);
      } else {
        const auto qkv = L.attn_in[0].forward(a_in, types);
        q = qkv.narrow(1, 0, n_heads_ * hd_).contiguous();
        k = qkv.narrow(1, n_heads_ * hd_, n_kv_ * hd_).contiguous();
        v = qkv.narrow(1, (n_heads_ + n_kv_) * hd_, n_kv_ * hd_).contiguous();
      }
      const auto att = attend(q, k, v, L, l, pos);  // (M, H hd)
      add_residual(x, L.o[0].forward(att, types), L.post_attn);
      const at::Tensor& m_in = norm_or_self(x, L.ln_2, L.ln_2_bias, h);
      at::Tensor g, u;  // (M, F) each; u undefined without a gate
      if (L.mlp_in.size() == 2) {
        g = L.mlp_in[0].forward(m_in, types);
        u = L.mlp_in[1].forward(m_in, types);
      } else if (gated_) {
        const auto gu = L.mlp_in[0].forward(m_in, types);
        const int64_t F = gu.size(1) / 2;
        g = gu.narrow(1, 0, F).contiguous();
        u = gu.narrow(1, F, F).contiguous();
      } else {
        g = L.mlp_in[0].forward(m_in, types);
      }
      AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "decode_mlp_activation", [&] {
        scalar_t* gp = g.data_ptr<scalar_t>();
        const scalar_t* up = u.defined() ? u.data_ptr<scalar_t>() : nullptr;
        for (int64_t i = 0; i < g.numel(); ++i) {
          const scalar_t a = activate<scalar_t>(gp[i], act_);
          gp[i] = up ? a * up[i] : a;
        }
      });
      add_residual(x, L.down[0].forward(g, types), L.post_mlp);
    }
    norm(x, final_norm_, final_norm_bias_, h);
    auto logits = head_.forward(h, types);  // (M, V)
    if (final_softcap_ > 0) logits.div_(final_softcap_).tanh_().mul_(final_softcap_);
    return logits;
  }

 private:
  // A norm's weight or bias: absent, or a contiguous vector of `width` elements (-1: any).
  void check_vector(const c10::optional<at::Tensor>& v, const char* what,
                    int64_t width) const {
    if (!v.has_value()) return;
    TORCH_CHECK(v->is_contiguous() && v->scalar_type() == embed_.scalar_type() &&
                    v->dim() == 1 && (width < 0 || v->numel() == width),
                "DecodeStack: ", what, ": a contiguous vector of ", width, " elements and the "
                "embedding's dtype expected, got ", v->sizes());
  }

  void check_linear(const ChainLinear& lin, int64_t in, int64_t out, const char* what) const {
    TORCH_CHECK(lin.in_features() == in && (out < 0 || lin.out_features() == out),
                "DecodeStack: ", what, " maps ", lin.in_features(), " -> ",
                lin.out_features(), " features, expected ", in, " -> ", out);
    TORCH_CHECK(lin.dtype() == embed_.scalar_type(), "DecodeStack: ", what,
                " has another dtype than the embedding");
    TORCH_CHECK(lin.max_slot() < types_.size(1), "DecodeStack: ", what, " reads type "
                "slot ", lin.max_slot(), " but the type table has ", types_.size(1));
    lin.check_types(types_, what);
  }

  // out = the model's norm of x (LayerNorm or RMSNorm).
  void norm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
            at::Tensor& out) const {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "decode_norm", [&] {
      if (layer_norm_) {
        layer_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                                  b.has_value() ? b->data_ptr<scalar_t>() : nullptr, eps_,
                                  x.size(0), x.size(1), out.data_ptr<scalar_t>());
      } else {
        rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), eps_,
                                x.size(0), x.size(1), out.data_ptr<scalar_t>());
      }
    });
  }

  // The norm of x into `out` where the layer has one, else x itself.
  const at::Tensor& norm_or_self(const at::Tensor& x, const c10::optional<at::Tensor>& w,
                                 const c10::optional<at::Tensor>& b, at::Tensor& out) const {
    if (!w.has_value()) return x;
    norm(x, *w, b, out);
    return out;
  }

  // x += post_norm(y) (or y without a post-norm).
  void add_residual(at::Tensor& x, at::Tensor y, const c10::optional<at::Tensor>& post) const {
    if (post.has_value()) norm(y, *post, c10::nullopt, y);
    x.add_(y);
  }

  // q/k norms and rotary embedding on q and k, k and v written into layer l's caches at
  // `pos`, then softmax(q K^T * scaling) V per (sequence, query head) over 0..pos, the
  // query heads of a group sharing their key/value head. Returns (M, H hd).
  at::Tensor attend(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const DecoderLayer& L,
                    size_t l, int64_t pos) {
    const int64_t M = batch_, H = n_heads_, KV = n_kv_, hd = hd_, keys = pos + 1;
    const int64_t group = H / KV, rot = cos_[L.rope].size(1);
    auto scores = at::empty({M * H, keys}, q.options());
    auto out = at::empty({M, H * hd}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decode_attend", [&] {
      scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* kp = k.data_ptr<scalar_t>();
      const scalar_t* vp = v.data_ptr<scalar_t>();
      if (L.q_norm.has_value()) {  // per head (rows of head_dim) or over the full width
        const int64_t qd = L.q_norm->numel(), kd = L.k_norm->numel();
        rms_norm_rows<scalar_t>(qp, L.q_norm->data_ptr<scalar_t>(), eps_, M * H * hd / qd, qd,
                                qp);
        rms_norm_rows<scalar_t>(kp, L.k_norm->data_ptr<scalar_t>(), eps_, M * KV * hd / kd, kd,
                                kp);
      }
      if (rot > 0) {
        const scalar_t* c = cos_[L.rope].data_ptr<scalar_t>() + pos * rot;
        const scalar_t* s = sin_[L.rope].data_ptr<scalar_t>() + pos * rot;
        rope<scalar_t>(qp, M * H, hd, rot, c, s);
        rope<scalar_t>(kp, M * KV, hd, rot, c, s);
      }
      scalar_t* kc = k_[l].data_ptr<scalar_t>();
      scalar_t* vc = v_[l].data_ptr<scalar_t>();
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < KV; ++j) {
          const int64_t at_ = ((m * KV + j) * cap_ + pos) * hd;
          std::copy(kp + (m * KV + j) * hd, kp + (m * KV + j + 1) * hd, kc + at_);
          std::copy(vp + (m * KV + j) * hd, vp + (m * KV + j + 1) * hd, vc + at_);
        }
      }
      const scalar_t scale = static_cast<scalar_t>(L.scaling);
      scalar_t* sc = scores.data_ptr<scalar_t>();
      at::parallel_for(0, M * H, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t m = i / H, kvh = (i % H) / group;
          const scalar_t* qh = qp + i * hd;
          const scalar_t* kh = kc + (m * KV + kvh) * cap_ * hd;
          for (int64_t t = 0; t < keys; ++t) {
            sc[i * keys + t] = structlm::dot1<scalar_t>(qh, kh + t * hd, hd) * scale;
          }
        }
      });
      if (attn_softcap_ > 0) scores.div_(attn_softcap_).tanh_().mul_(attn_softcap_);
      const auto probs = at::softmax(scores, 1);  // (M H, keys), vectorised exp
      const scalar_t* pr = probs.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, M * H, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t m = i / H, kvh = (i % H) / group;
          const scalar_t* __restrict vh = vc + (m * KV + kvh) * cap_ * hd;
          const scalar_t* __restrict p = pr + i * keys;
          scalar_t* __restrict o = op + i * hd;
          std::fill(o, o + hd, scalar_t(0));
          for (int64_t t = 0; t < keys; ++t) {
            for (int64_t e = 0; e < hd; ++e) o[e] += p[t] * vh[t * hd + e];
          }
        }
      });
    });
    return out;
  }

  at::Tensor embed_;
  double embed_scale_;
  c10::optional<at::Tensor> pos_embed_;
  std::vector<DecoderLayer> layers_;
  at::Tensor final_norm_;
  c10::optional<at::Tensor> final_norm_bias_;
  ChainLinear head_;
  double eps_;
  bool layer_norm_;
  int64_t n_heads_, n_kv_, hd_;
  bool gated_;
  double attn_softcap_, final_softcap_;
  Activation act_ = Activation::kSilu;
  std::vector<at::Tensor> cos_, sin_;
  at::Tensor types_;
  int64_t D_ = 0, cap_ = 0, batch_ = 0;
  std::vector<at::Tensor> k_, v_;
  std::mutex mutex_;
};

void register_decode_hf(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<BoundRows>(m, "BoundRows", "one weight bound for few-row products of one type")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t>(),
           py::arg("typed"), py::arg("out_off"), py::arg("in_off"), py::arg("uses"),
           py::arg("q"), py::arg("slot"))
      .def_property_readonly("out_features", &BoundRows::out_features)
      .def_property_readonly("in_features", &BoundRows::in_features)
      .def_property_readonly("n_types", &BoundRows::n_types);
  py::class_<ChainLinear>(m, "ChainLinear", "a sum of chains of bound weights, plus a bias")
      .def(py::init<std::vector<std::vector<BoundRows>>, c10::optional<at::Tensor>>(),
           py::arg("terms"), py::arg("bias"))
      .def_property_readonly("in_features", &ChainLinear::in_features)
      .def_property_readonly("out_features", &ChainLinear::out_features);
  py::class_<DecoderLayer>(m, "DecoderLayer", "one decoder layer's parameters")
      .def(py::init([](c10::optional<at::Tensor> ln_1, c10::optional<at::Tensor> ln_1_bias,
                       c10::optional<at::Tensor> ln_2, c10::optional<at::Tensor> ln_2_bias,
                       c10::optional<at::Tensor> post_attn,
                       c10::optional<at::Tensor> post_mlp, std::vector<ChainLinear> attn_in,
                       ChainLinear o, std::vector<ChainLinear> mlp_in, ChainLinear down,
                       c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                       double scaling, int64_t rope) {
             return DecoderLayer{std::move(ln_1), std::move(ln_1_bias), std::move(ln_2),
                                 std::move(ln_2_bias), std::move(post_attn),
                                 std::move(post_mlp), std::move(attn_in), {std::move(o)},
                                 std::move(mlp_in), {std::move(down)}, std::move(q_norm),
                                 std::move(k_norm), scaling, rope};
           }),
           py::arg("ln_1"), py::arg("ln_1_bias"), py::arg("ln_2"), py::arg("ln_2_bias"),
           py::arg("post_attn"), py::arg("post_mlp"), py::arg("attn_in"), py::arg("o"),
           py::arg("mlp_in"), py::arg("down"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("scaling"), py::arg("rope") = 0);
  py::class_<DecodeStack>(m, "DecodeStack", "a decoder's decode step, caches owned")
      .def(py::init<at::Tensor, double, c10::optional<at::Tensor>, std::vector<DecoderLayer>,
                    at::Tensor, c10::optional<at::Tensor>, ChainLinear, double, bool, int64_t,
                    int64_t, int64_t, const std::string&, bool, double, double,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>(),
           py::arg("embed"), py::arg("embed_scale"), py::arg("pos_embed"), py::arg("layers"),
           py::arg("final_norm"), py::arg("final_norm_bias"), py::arg("head"), py::arg("eps"),
           py::arg("layer_norm"), py::arg("n_heads"), py::arg("n_kv"), py::arg("head_dim"),
           py::arg("act"), py::arg("gated"), py::arg("attn_softcap"), py::arg("final_softcap"),
           py::arg("cos"), py::arg("sin"), py::arg("types"))
      .def_property_readonly("capacity", &DecodeStack::capacity)
      .def("reset", &DecodeStack::reset, py::arg("batch"))
      .def("set_cache", &DecodeStack::set_cache, py::arg("layer"), py::arg("k"), py::arg("v"))
      .def("step", &DecodeStack::step, py::arg("ids"), py::arg("pos"),
           py::call_guard<py::gil_scoped_release>());
}
