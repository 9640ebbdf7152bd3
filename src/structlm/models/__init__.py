"""The decoder LM (Hugging Face compatible); registered with the Auto* classes.

Needs ``transformers`` (the ``lm`` extra); imported lazily by the rest of the package.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from structlm.models.configuration_structlm import StructLMConfig
from structlm.models.modeling_structlm import StructLMForCausalLM, StructLMModel
from structlm.models.presets import PRESETS, config_from_preset

AutoConfig.register("structlm", StructLMConfig, exist_ok=True)
AutoModelForCausalLM.register(StructLMConfig, StructLMForCausalLM, exist_ok=True)

__all__ = ["PRESETS", "StructLMConfig", "StructLMForCausalLM", "StructLMModel",
           "config_from_preset"]
