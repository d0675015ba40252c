"""The library, the bottom layer (docs/design.md): EAGLE-2 / EAGLE-3 / P-EAGLE head kinds and heads (`EagleHead`,
`Eagle3Head`, `PeagleHead`, `load_head`), the target adapter with its preallocated KV cache, draft trees, lossless verification and
`EaModel`, the decoding API. The stages above import it, in the order of pyproject.toml's layers contract: eagle <-
recipes <- engine <- data_prep <- train <- export <- evaluation <- quickstart, benchmarks <- eagle_train (the
`eagle-train` command)."""
from eagle.decoding_config import DecodingConfig
from eagle.eagle2 import EagleHead
from eagle.eagle3 import Eagle3Head
from eagle.peagle import PeagleHead
from eagle.head_config import HeadConfig, head_config_from_target
from eagle.head_files import load_head
from eagle.head_kinds import HeadConfigError
from eagle.target_weights import load_target_embedding_and_lm_head

__all__ = ["DecodingConfig", "EagleHead", "Eagle3Head", "PeagleHead", "HeadConfig", "HeadConfigError", "load_head", "head_config_from_target", "load_target_embedding_and_lm_head", "EaModel"]


def __getattr__(name):
    if name == "EaModel":
        # lazy: EaModel's target adapter imports transformers (seconds); `import eagle` stays as light as the heads
        from eagle.ea_model import EaModel

        return EaModel
    raise AttributeError(name)
