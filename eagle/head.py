"""The draft heads, one import away: EAGLE-1/2 (`EagleHead`, eagle/eagle2.py) and EAGLE-3 (`Eagle3Head`,
eagle/eagle3.py), their config (eagle/head_config.py), their kinds (eagle/head_kinds.py), head folders
(eagle/head_files.py) and the target tensors they take (eagle/target_weights.py). This module only hands those
names on, so `from eagle.head import ...` keeps working; code inside the project imports them where they live."""
from eagle.eagle2 import EagleHead
from eagle.eagle3 import Eagle3Head, Eagle3Layer
from eagle.peagle import PeagleHead
from eagle.head_config import HeadConfig, check_head_fits_target, head_config_from_target, read_head_config
from eagle.head_files import (CONFIG_NAME, LEGACY_WEIGHTS_NAME, SAFE_WEIGHTS_NAME, load_weights, resolve_head_files,
                              check_head_files, head_class, load_head)
from eagle.head_kinds import (HEAD_KINDS, N_AUX_LAYERS, HeadConfigError, check_aux_layers, default_aux_layers,
                              text_config)
from eagle.head_module import HeadModule, count_parameters
from eagle.layers import (MLP, Attention, DecoderLayer, RMSNorm, Rotary, accumulation_dtype, init_head_weights, linear_t,
                          positions_end, rms_norm, rotate_half, rotate_rolled, rows_at, signed_sin)
from eagle.target_weights import EMBED_KEYS, LM_HEAD_KEYS, load_target_embedding_and_lm_head
from eagle.unroll import UNROLL_ROW_CHUNKS, prefix_diag_attention, unroll_self_fed

__all__ = [
    "HeadConfig", "HeadConfigError", "EagleHead", "Eagle3Head", "PeagleHead", "load_head", "head_class", "head_config_from_target",
    "check_aux_layers", "default_aux_layers", "load_target_embedding_and_lm_head", "count_parameters",
    "HEAD_KINDS", "N_AUX_LAYERS", "CONFIG_NAME", "SAFE_WEIGHTS_NAME", "LEGACY_WEIGHTS_NAME", "text_config",
    "check_head_fits_target", "read_head_config", "check_head_files", "HeadModule", "Eagle3Layer", "UNROLL_ROW_CHUNKS",
    "MLP", "Attention", "DecoderLayer", "RMSNorm", "Rotary", "init_head_weights", "linear_t", "positions_end",
    "rms_norm", "rotate_half", "rotate_rolled", "rows_at", "signed_sin", "EMBED_KEYS", "LM_HEAD_KEYS",
    "load_weights", "resolve_head_files", "prefix_diag_attention", "unroll_self_fed",
]
