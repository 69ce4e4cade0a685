"""The transformers fallback (--model-impl transformers): any causal LM transformers can build, with its attention
routed to kvengine's paged attention through transformers' attention-interface registry.

transformers runs the model's own modules over the step's flattened tokens (one batch row, the positions as
position_ids, no cache of its own, no mask); each attention module calls `paged_attention_interface`, which writes
the layer's K/V into kvengine's paged cache and attends with the step's attention metadata, so the ledger,
scheduler, prefix cache and API work as with a native model. What the attention asks for and kvengine cannot do
(another window than the KV cache spec's, a bias on the scores, attention sinks, non-causal attention) is refused,
never ignored. Tensor parallel size 1 only.
"""

import contextvars
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from protocol.model.config import ModelConfig
from worker.attention_backends import Attention
from worker.parallel import TPGroup

IMPLEMENTATION = "kvengine_paged"
MIN_VERSION = 5


def import_transformers():
    """transformers, or an error naming the optional extra (it is not a dependency of the engine)."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "--model-impl transformers needs transformers: pip install 'kvengine[transformers]'"
        ) from e
    if int(transformers.__version__.split(".")[0]) < MIN_VERSION:
        raise ImportError(f"--model-impl transformers needs transformers >= {MIN_VERSION}, "
                          f"not {transformers.__version__}: pip install 'kvengine[transformers]'")
    return transformers


@dataclass
class Step:
    """What the attention modules of one forward read: each layer's cache and metadata, the backend, how many of
    the rows are real tokens (the rest padding), and what the KV cache specs say of every layer (its window, the
    KV heads and head size)."""

    caches: list
    metas: list
    attention: Attention
    num_tokens: int
    windows: list[int | None]
    kv_heads: int
    head_dim: int


_STEP: contextvars.ContextVar[Step] = contextvars.ContextVar("kvengine_step")


def paged_attention_interface(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention call (query [1, heads, rows, hd], key and value [1, kv_heads, rows, hd]) on the
    paged cache; returns [1, rows, heads, hd]."""
    step, layer = _STEP.get(), getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx: its layer's KV cache cannot be found")
    _check_supported(module, layer, attention_mask, kwargs, step.windows[layer])
    if key.shape[1] != step.kv_heads or key.shape[3] != step.head_dim:
        raise ValueError(f"layer {layer} has {key.shape[1]} KV heads of {key.shape[3]} dims, but the KV cache spec "
                         f"gives every layer {step.kv_heads} of {step.head_dim}")
    n, rows = step.num_tokens, query.shape[2]
    q, k, v = (x[0].transpose(0, 1)[:n] for x in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.attention(q, k, v, step.caches[layer], step.metas[layer], scale, kwargs.get("softcap"))
    if n < rows:
        out = F.pad(out, (0, 0, 0, rows - n))
    return out.view(1, rows, query.shape[1], query.shape[3]), None


def _check_supported(module, layer: int, attention_mask, kwargs: dict, window: int | None) -> None:
    where = f"layer {layer} ({type(module).__name__})"
    if kwargs.get("sliding_window") != window:
        raise ValueError(f"{where} attends over a window of {kwargs.get('sliding_window')} tokens but its KV cache "
                         f"spec says {window}")
    for name in ("position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: kvengine's paged attention has no {name} (a bias on the scores, sinks)")
    if attention_mask is not None or not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError(f"{where}: kvengine's paged attention is causal, without an attention mask")


class _BaseOutputs:
    """A base model's outputs with only the final hidden states: any other field a causal LM reads is None."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:
        return None

    def __getitem__(self, i: int) -> torch.Tensor:
        if i != 0:
            raise IndexError(i)
        return self.last_hidden_state


class _Hidden(torch.nn.Module):
    """Stands in for a causal LM's base model: returns given final hidden states, so that the causal LM's own
    forward turns them into logits (its LM head and whatever scaling or capping it applies)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> _BaseOutputs:
        return _BaseOutputs(self.hidden)


@dataclass
class _Layer:
    sliding_window: int | None


class TransformersModel:
    """The model runner's view of a transformers causal LM (as LlamaModel offers it)."""

    cuda_graphs = False  # its modules run eagerly

    def __init__(self, folder: str | Path, cfg: ModelConfig, tp: TPGroup, dtype, device):
        transformers = import_transformers()
        transformers.AttentionInterface.register(IMPLEMENTATION, paged_attention_interface)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=IMPLEMENTATION)
        self.hf = hf.to(device).eval()
        self.base_name = self.hf.base_model_prefix
        self.cfg, self.tp = cfg, tp
        self.layers = [_Layer(w) for w in cfg.layer_sliding_windows]
        head = self.hf.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear):
            raise TypeError(f"{cfg.architecture}: transformers gives no linear output embeddings (LM head)")
        self.lm_head = head  # the runner reads where the logits will be

    @property
    def kv_heads_per_rank(self) -> int:
        return self.cfg.num_key_value_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_tokens: int, caches: list, metas: list,
                attention: Attention) -> torch.Tensor:
        """As LlamaModel.forward: final hidden states of the step's first num_tokens tokens."""
        cfg = self.cfg
        token = _STEP.set(Step(caches, metas, attention, num_tokens, cfg.layer_sliding_windows,
                               cfg.num_key_value_heads, cfg.head_dim))
        try:
            base = getattr(self.hf, self.base_name)
            out = base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0, :num_tokens]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The causal LM's own forward from these hidden states on: its LM head, logit scaling and capping."""
        base = getattr(self.hf, self.base_name)
        setattr(self.hf, self.base_name, _Hidden(hidden.unsqueeze(0)))
        try:
            ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            return self.hf(input_ids=ids, use_cache=False).logits[0]
        finally:
            setattr(self.hf, self.base_name, base)


def fallback_config(hf_config, architecture: str) -> ModelConfig:
    """What the worker needs of a model served by transformers, read from its transformers config: sizes, KV heads,
    head size and each layer's sliding window."""
    heads, n = hf_config.num_attention_heads, hf_config.num_hidden_layers
    eos = getattr(hf_config, "eos_token_id", None)
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=getattr(hf_config, "intermediate_size", 0) or 0,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        rms_norm_eps=0.0,
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", None) or 2048,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        layer_sliding_windows=layer_windows(hf_config),
        layer_ropes=[None] * n,
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
    )


def layer_windows(hf_config) -> list[int | None]:
    """Per layer: its sliding window as transformers' config says (layer_types, else sliding_window for all)."""
    n, window = hf_config.num_hidden_layers, getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if not types:
        return [window] * n
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} have no KV cache spec in kvengine")
    return [window if t == "sliding_attention" else None for t in types]
