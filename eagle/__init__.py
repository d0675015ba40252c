"""EAGLE-2 speculative decoding: draft head, target adapter, draft trees, lossless verification."""
from eagle.decoding_config import DecodingConfig
from eagle.head import (Eagle3Head, EagleHead, HeadConfig, HeadConfigError, head_config_from_target, load_head,
                        load_target_embedding_and_lm_head)

__all__ = ["DecodingConfig", "EagleHead", "Eagle3Head", "HeadConfig", "HeadConfigError", "load_head", "head_config_from_target", "load_target_embedding_and_lm_head", "EaModel"]


def __getattr__(name):  # EaModel pulls in transformers model code; import it on first use
    if name == "EaModel":
        from eagle.ea_model import EaModel

        return EaModel
    raise AttributeError(name)
