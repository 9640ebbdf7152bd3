// One decode step of a LLaMA-family decoder (LLaMA, Mistral, Qwen2, Qwen3: RMSNorm
// pre-norms, rotary positions, grouped-query attention, a SiLU-gated MLP) for one new
// token per sequence, the whole model in one call: embedding row, every layer, final
// norm, LM head. Every projection is a `ChainLinear`: a sum of chains of bound weights
// (`BoundRows`: a dense weight, or an algebra layer's typed copies, each reading its type
// from the step's type table), so plain, converted (`convert_`) and compressed (low-rank,
// shared-basis) models run the same code. Replaces the ~40 Python-dispatched ops per
// layer of a Hugging Face decode step. The reference is the model's own forward; tests
// compare the two (structlm.hf.fused_decode).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "dot.h"
#include "rows_kernel.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {

using structlm::BoundRows;

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

// One decoder layer's parameters. attn_in: [q, k, v] or one stacked [q; k; v];
// mlp_in: [gate, up] or one stacked [gate; up]; q_norm / k_norm: per-head RMSNorm weights
// after the projections (Qwen3) or undefined.
struct LlamaLayer {
  at::Tensor ln_1, ln_2;
  std::vector<ChainLinear> attn_in;
  std::vector<ChainLinear> o;  // one
  std::vector<ChainLinear> mlp_in;
  std::vector<ChainLinear> down;  // one
  c10::optional<at::Tensor> q_norm, k_norm;
};

// y = x / sqrt(mean(x^2) + eps) * w over rows of width d (HF's RMSNorm; mean in double).
template <typename T>
void rms_norm_rows(const T* x, const T* w, double eps, int64_t rows, int64_t d, T* y) {
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * d;
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const T inv = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
    for (int64_t i = 0; i < d; ++i) y[m * d + i] = w[i] * (xr[i] * inv);
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
class LlamaDecodeStack {
 public:
  LlamaDecodeStack(at::Tensor embed, std::vector<LlamaLayer> layers, at::Tensor final_norm,
                   ChainLinear head, double eps, int64_t n_heads, int64_t n_kv,
                   int64_t head_dim, double scaling, at::Tensor cos, at::Tensor sin,
                   at::Tensor types)
      : embed_(std::move(embed)), layers_(std::move(layers)),
        final_norm_(std::move(final_norm)), head_(std::move(head)), eps_(eps),
        n_heads_(n_heads), n_kv_(n_kv), hd_(head_dim), scaling_(scaling),
        cos_(std::move(cos)), sin_(std::move(sin)), types_(std::move(types)) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.is_contiguous(), "LlamaDecodeStack: embedding "
                "(V, D) contiguous expected");
    D_ = embed_.size(1);
    const auto dt = embed_.scalar_type();
    TORCH_CHECK(n_heads_ > 0 && n_kv_ > 0 && n_heads_ % n_kv_ == 0, "LlamaDecodeStack: ",
                n_heads_, " query heads cannot share ", n_kv_, " key/value heads");
    TORCH_CHECK(cos_.dim() == 2 && cos_.sizes() == sin_.sizes() && cos_.is_contiguous() &&
                    sin_.is_contiguous() && cos_.scalar_type() == dt &&
                    sin_.scalar_type() == dt && cos_.size(1) <= hd_ && cos_.size(1) % 2 == 0,
                "LlamaDecodeStack: rotary tables (capacity, rot <= head_dim, even) of the "
                "embedding's dtype expected, got ", cos_.sizes());
    cap_ = cos_.size(0);
    TORCH_CHECK(types_.dim() == 2 && types_.size(0) == cap_ &&
                    types_.scalar_type() == at::kLong && types_.is_contiguous(),
                "LlamaDecodeStack: a type table (", cap_, ", slots) int64 expected, got ",
                types_.sizes());
    check_linear(head_, D_, -1, "lm_head");
    TORCH_CHECK(final_norm_.numel() == D_ && final_norm_.is_contiguous() &&
                    final_norm_.scalar_type() == dt, "LlamaDecodeStack: final norm (", D_,
                ",) expected");
    const int64_t q_width = n_heads_ * hd_, kv_width = n_kv_ * hd_;
    for (const auto& L : layers_) {
      TORCH_CHECK(L.ln_1.numel() == D_ && L.ln_2.numel() == D_ && L.ln_1.is_contiguous() &&
                      L.ln_2.is_contiguous() && L.ln_1.scalar_type() == dt &&
                      L.ln_2.scalar_type() == dt, "LlamaDecodeStack: layer norms (", D_,
                  ",) expected");
      TORCH_CHECK(L.o.size() == 1 && L.down.size() == 1, "LlamaDecodeStack: one o and one "
                  "down projection per layer expected");
      if (L.attn_in.size() == 3) {
        check_linear(L.attn_in[0], D_, q_width, "q_proj");
        check_linear(L.attn_in[1], D_, kv_width, "k_proj");
        check_linear(L.attn_in[2], D_, kv_width, "v_proj");
      } else {
        TORCH_CHECK(L.attn_in.size() == 1, "LlamaDecodeStack: attention input: q, k, v or "
                    "one stacked projection expected");
        check_linear(L.attn_in[0], D_, q_width + 2 * kv_width, "qkv_proj");
      }
      check_linear(L.o[0], q_width, D_, "o_proj");
      TORCH_CHECK(L.mlp_in.size() == 1 || L.mlp_in.size() == 2, "LlamaDecodeStack: MLP "
                  "input: gate and up or one stacked projection expected");
      const int64_t F = L.down[0].in_features();
      for (const auto& lin : L.mlp_in) {
        check_linear(lin, D_, L.mlp_in.size() == 2 ? F : 2 * F, "MLP input");
      }
      check_linear(L.down[0], F, D_, "down_proj");
      for (const auto* norm : {&L.q_norm, &L.k_norm}) {
        TORCH_CHECK(!norm->has_value() || ((*norm)->numel() == hd_ &&
                                           (*norm)->is_contiguous() &&
                                           (*norm)->scalar_type() == dt),
                    "LlamaDecodeStack: q/k norms of head_dim ", hd_, " expected");
      }
    }
    reset(1);
  }

  int64_t capacity() const { return cap_; }
  int64_t n_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Empty caches for `batch` sequences: (batch, n_kv, capacity, head_dim) per layer.
  void reset(int64_t batch) {
    TORCH_CHECK(batch >= 1, "LlamaDecodeStack: batch ", batch, " must be >= 1");
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
    at::Tensor h = at::empty_like(x);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LlamaLayer& L = layers_[l];
      norm(x, L.ln_1, h);
      at::Tensor q, k, v;  // (M, H hd), (M, KV hd) x 2, contiguous
      if (L.attn_in.size() == 3) {
        q = L.attn_in[0].forward(h, types);
        k = L.attn_in[1].forward(h, types);
        v = L.attn_in[2].forward(h, types);
      } else {
        const auto qkv = L.attn_in[0].forward(h, types);
        q = qkv.narrow(1, 0, n_heads_ * hd_).contiguous();
        k = qkv.narrow(1, n_heads_ * hd_, n_kv_ * hd_).contiguous();
        v = qkv.narrow(1, (n_heads_ + n_kv_) * hd_, n_kv_ * hd_).contiguous();
      }
      const auto att = attend(q, k, v, L, l, pos);  // (M, H hd)
      x.add_(L.o[0].forward(att, types));
      norm(x, L.ln_2, h);
      at::Tensor g, u;  // (M, F) each
      if (L.mlp_in.size() == 2) {
        g = L.mlp_in[0].forward(h, types);
        u = L.mlp_in[1].forward(h, types);
      } else {
        const auto gu = L.mlp_in[0].forward(h, types);
        const int64_t F = gu.size(1) / 2;
        g = gu.narrow(1, 0, F).contiguous();
        u = gu.narrow(1, F, F).contiguous();
      }
      AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "llama_silu_gate", [&] {
        scalar_t* gp = g.data_ptr<scalar_t>();
        const scalar_t* up = u.data_ptr<scalar_t>();
        for (int64_t i = 0; i < g.numel(); ++i) {
          gp[i] = gp[i] / (scalar_t(1) + std::exp(-gp[i])) * up[i];
        }
      });
      x.add_(L.down[0].forward(g, types));
    }
    norm(x, final_norm_, h);
    return head_.forward(h, types);  // (M, V)
  }

 private:
  void check_linear(const ChainLinear& lin, int64_t in, int64_t out, const char* what) const {
    TORCH_CHECK(lin.in_features() == in && (out < 0 || lin.out_features() == out),
                "LlamaDecodeStack: ", what, " maps ", lin.in_features(), " -> ",
                lin.out_features(), " features, expected ", in, " -> ", out);
    TORCH_CHECK(lin.dtype() == embed_.scalar_type(), "LlamaDecodeStack: ", what,
                " has another dtype than the embedding");
    TORCH_CHECK(lin.max_slot() < types_.size(1), "LlamaDecodeStack: ", what, " reads type "
                "slot ", lin.max_slot(), " but the type table has ", types_.size(1));
  }

  void norm(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) const {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "llama_rms_norm", [&] {
      rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), eps_, x.size(0),
                              x.size(1), out.data_ptr<scalar_t>());
    });
  }

  // q/k norms and rotary embedding on q and k, k and v written into layer l's caches at
  // `pos`, then softmax(q K^T * scaling) V per (sequence, query head) over 0..pos, the
  // query heads of a group sharing their key/value head. Returns (M, H hd).
  at::Tensor attend(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const LlamaLayer& L,
                    size_t l, int64_t pos) {
    const int64_t M = batch_, H = n_heads_, KV = n_kv_, hd = hd_, keys = pos + 1;
    const int64_t group = H / KV, rot = cos_.size(1);
    auto scores = at::empty({M * H, keys}, q.options());
    auto out = at::empty({M, H * hd}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "llama_attend", [&] {
      scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* kp = k.data_ptr<scalar_t>();
      const scalar_t* vp = v.data_ptr<scalar_t>();
      if (L.q_norm.has_value()) {
        rms_norm_rows<scalar_t>(qp, L.q_norm->data_ptr<scalar_t>(), eps_, M * H, hd, qp);
        rms_norm_rows<scalar_t>(kp, L.k_norm->data_ptr<scalar_t>(), eps_, M * KV, hd, kp);
      }
      const scalar_t* c = cos_.data_ptr<scalar_t>() + pos * rot;
      const scalar_t* s = sin_.data_ptr<scalar_t>() + pos * rot;
      rope<scalar_t>(qp, M * H, hd, rot, c, s);
      rope<scalar_t>(kp, M * KV, hd, rot, c, s);
      scalar_t* kc = k_[l].data_ptr<scalar_t>();
      scalar_t* vc = v_[l].data_ptr<scalar_t>();
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < KV; ++j) {
          const int64_t at_ = ((m * KV + j) * cap_ + pos) * hd;
          std::copy(kp + (m * KV + j) * hd, kp + (m * KV + j + 1) * hd, kc + at_);
          std::copy(vp + (m * KV + j) * hd, vp + (m * KV + j + 1) * hd, vc + at_);
        }
      }
      const scalar_t scale = static_cast<scalar_t>(scaling_);
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
  std::vector<LlamaLayer> layers_;
  at::Tensor final_norm_;
  ChainLinear head_;
  double eps_;
  int64_t n_heads_, n_kv_, hd_;
  double scaling_;
  at::Tensor cos_, sin_, types_;
  int64_t D_ = 0, cap_ = 0, batch_ = 0;
  std::vector<at::Tensor> k_, v_;
};

void register_decode_llama(pybind11::module_& m) {
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
  py::class_<LlamaLayer>(m, "LlamaLayer", "one LLaMA-family decoder layer's parameters")
      .def(py::init([](at::Tensor ln_1, at::Tensor ln_2, std::vector<ChainLinear> attn_in,
                       ChainLinear o, std::vector<ChainLinear> mlp_in, ChainLinear down,
                       c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
                         "LlamaLayer: q and k norms come together");
             return LlamaLayer{std::move(ln_1), std::move(ln_2), std::move(attn_in),
                               {std::move(o)}, std::move(mlp_in), {std::move(down)},
                               std::move(q_norm), std::move(k_norm)};
           }),
           py::arg("ln_1"), py::arg("ln_2"), py::arg("attn_in"), py::arg("o"),
           py::arg("mlp_in"), py::arg("down"), py::arg("q_norm"), py::arg("k_norm"));
  py::class_<LlamaDecodeStack>(m, "LlamaDecodeStack",
                               "a LLaMA-family model's decode step, caches owned")
      .def(py::init<at::Tensor, std::vector<LlamaLayer>, at::Tensor, ChainLinear, double,
                    int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor, at::Tensor>(),
           py::arg("embed"), py::arg("layers"), py::arg("final_norm"), py::arg("head"),
           py::arg("eps"), py::arg("n_heads"), py::arg("n_kv"), py::arg("head_dim"),
           py::arg("scaling"), py::arg("cos"), py::arg("sin"), py::arg("types"))
      .def_property_readonly("capacity", &LlamaDecodeStack::capacity)
      .def("reset", &LlamaDecodeStack::reset, py::arg("batch"))
      .def("set_cache", &LlamaDecodeStack::set_cache, py::arg("layer"), py::arg("k"),
           py::arg("v"))
      .def("step", &LlamaDecodeStack::step, py::arg("ids"), py::arg("pos"),
           py::call_guard<py::gil_scoped_release>());
}
