"""Parameter counts of a planned model: given directly, or computed from a config of layer counts and widths.

:func:`shape_from_config` reads a Hugging Face-style ``config.json`` (or a TOML/JSON file with the same
keys) into a :class:`ModelShape`; :meth:`ModelShape.parameters` counts its parameters and how they fall on
pipeline stages. The count follows the decoder families these configs describe:

- Llama-style (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``vocab_size``,
  ``num_attention_heads``, optional ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings``,
  ``attention_bias``, ``mlp_bias``; Mistral and Qwen2, whose q/k/v biases are implied by ``model_type``):
  token embedding; per layer q/k/v/o projections (k and v sized by the
  key-value heads), a gated MLP (gate, up, down) and two RMSNorm weights; a final norm; an LM head unless
  the embeddings are tied. Mixture-of-experts configs (``num_local_experts`` as Mixtral, or
  ``num_experts``) hold that many MLPs per layer plus a router (hidden x experts).
- GPT-2-style (``n_layer``, ``n_embd``, ``n_head``, optional ``n_inner``, ``n_positions``): token and
  position embeddings, biases on every projection, LayerNorms with bias, a 4x non-gated MLP, tied LM head.

Pure arithmetic; no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.errors import ConfigError

#: MoE layouts this count does not model (shared experts, dense first layers): refused with a hint.
_UNSUPPORTED_MOE_KEYS = ("n_routed_experts", "n_shared_experts", "moe_layer_freq", "first_k_dense_replace",
                         "shared_expert_intermediate_size", "decoder_sparse_step")
#: Model types whose q, k and v projections carry a bias though their configs do not say so.
_QKV_BIAS_TYPES = frozenset({"qwen2"})


@dataclass(frozen=True)
class ModelShape:
    """The widths and counts that decide a decoder's parameter count (see the module docstring)."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool = False
    experts: int = 1
    gated_mlp: bool = True
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    positions: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "intermediate", "vocab", "heads", "kv_heads", "head_dim", "experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.positions < 0:
            raise ConfigError(f"model config: positions must be >= 0, got {self.positions!r}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model config: num_attention_heads ({self.heads}) is not a multiple of "
                              f"num_key_value_heads ({self.kv_heads})")

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise :class:`ConfigError` unless ``tp`` ranks can split the attention heads (each rank takes whole
        query heads, and whole key-value heads or a replica of one)."""
        if self.heads % tp:
            raise ConfigError(f"--tp {tp} does not divide the model's {self.heads} attention heads")
        if self.kv_heads % tp and tp % self.kv_heads:
            raise ConfigError(f"--tp {tp} and the model's {self.kv_heads} key-value heads do not divide one another")

    def parameters(self) -> ParameterCount:
        """Every parameter, split into the embedding and head (pipeline ends), the layers, and experts."""
        h = self.hidden
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q_width + 2 * h * kv_width + q_width * h
        if self.attention_bias or self.qkv_bias:
            attention += q_width + 2 * kv_width + (h if self.attention_bias else 0)
        mlp_matrices = 3 if self.gated_mlp else 2
        one_mlp = mlp_matrices * h * self.intermediate
        if self.mlp_bias:
            one_mlp += (mlp_matrices - 1) * self.intermediate + h
        norms = 2 * h * (2 if self.norm_bias else 1)
        router = h * self.experts if self.experts > 1 else 0
        expert_per_layer = one_mlp * self.experts if self.experts > 1 else 0
        dense_per_layer = attention + norms + router + (0 if self.experts > 1 else one_mlp)
        embedding = self.vocab * h + self.positions * h
        final_norm = h * (2 if self.norm_bias else 1)
        head = 0 if self.tied_embeddings else self.vocab * h
        return ParameterCount(layers=self.layers, dense_per_layer=dense_per_layer,
                              expert_per_layer=expert_per_layer, first_stage_extra=embedding,
                              last_stage_extra=final_norm + head)


@dataclass(frozen=True)
class ParameterCount:
    """A model's parameters as pipeline stages see them: ``layers`` equal layers, each with dense and expert
    parameters, what only the first stage (embeddings) and the last stage (final norm, LM head) hold, and
    parameters known only as totals (``--params``), which every stage holds an equal share of."""

    layers: int = 0
    dense_per_layer: int = 0
    expert_per_layer: int = 0
    first_stage_extra: int = 0
    last_stage_extra: int = 0
    flat_dense: int = 0
    flat_expert: int = 0

    @classmethod
    def flat(cls, total: int, expert: int = 0) -> ParameterCount:
        """A count known only as a total, ``expert`` of it in experts."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ConfigError(f"the parameter count must be a positive number, got {total!r}")
        if not 0 <= expert <= total:
            raise ConfigError(f"the expert parameters ({expert}) must lie between 0 and the total ({total})")
        return cls(flat_dense=total - expert, flat_expert=expert)

    @property
    def total(self) -> int:
        return self.layers * (self.dense_per_layer + self.expert_per_layer) + self.first_stage_extra \
            + self.last_stage_extra + self.flat_dense + self.flat_expert

    @property
    def expert(self) -> int:
        return self.layers * self.expert_per_layer + self.flat_expert

    def stages(self, pp: int) -> list[tuple[int, int]]:
        """(dense, expert) parameters of each of ``pp`` pipeline stages: layers split as evenly as possible
        (the first stages take one more when they do not divide), embeddings on the first stage, final norm
        and LM head on the last, totals without layers in equal shares."""
        if self.layers and pp > self.layers:
            raise ConfigError(f"--pp {pp} exceeds the model's {self.layers} layers; each pipeline stage needs "
                              "at least one layer")
        result = []
        for stage in range(pp):
            count = _share(self.layers, pp, stage)
            dense = count * self.dense_per_layer + _share(self.flat_dense, pp, stage)
            if stage == 0:
                dense += self.first_stage_extra
            if stage == pp - 1:
                dense += self.last_stage_extra
            result.append((dense, count * self.expert_per_layer + _share(self.flat_expert, pp, stage)))
        return result


def _share(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split into ``parts`` integers as evenly as possible (first parts larger)."""
    base, extra = divmod(total, parts)
    return base + (1 if index < extra else 0)


def _integer(config: Mapping[str, Any], source: str, *names: str, default: int | None = None) -> int:
    for name in names:
        if name in config and config[name] is not None:
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{source}: {name} must be an integer, got {value!r}")
            return value
    if default is None:
        raise ConfigError(f"{source}: missing {' or '.join(names)}; a model config needs the layer count and "
                          "widths (num_hidden_layers, hidden_size, intermediate_size, vocab_size, "
                          "num_attention_heads), or give --params instead")
    return default


def shape_from_config(config: Mapping[str, Any], *, source: str = "model config",
                      tied_embeddings: bool | None = None) -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face-style config (see the module docstring for the keys).

    ``tied_embeddings`` overrides the config's ``tie_word_embeddings``. Raises :class:`ConfigError` naming
    ``source`` and the key for a missing or malformed value, or an MoE layout this count does not model."""
    for key in _UNSUPPORTED_MOE_KEYS:
        if key in config:
            raise ConfigError(f"{source}: {key} describes a mixture-of-experts layout ckptd plan does not count; "
                              "give --params and --expert-params instead")
    if "n_embd" in config or "n_layer" in config:
        hidden = _integer(config, source, "n_embd")
        heads = _integer(config, source, "n_head")
        return ModelShape(
            layers=_integer(config, source, "n_layer"), hidden=hidden,
            intermediate=_integer(config, source, "n_inner", default=4 * hidden), vocab=_integer(config, source, "vocab_size"),
            heads=heads, kv_heads=heads, head_dim=_head_dim(hidden, heads, source),
            tied_embeddings=True if tied_embeddings is None else tied_embeddings, gated_mlp=False,
            attention_bias=True, mlp_bias=True, norm_bias=True, positions=_integer(config, source, "n_positions", default=1024))
    hidden = _integer(config, source, "hidden_size")
    heads = _integer(config, source, "num_attention_heads")
    experts = _integer(config, source, "num_local_experts", "num_experts", default=1)
    intermediate = _integer(config, source, "moe_intermediate_size", "intermediate_size") if experts > 1 \
        else _integer(config, source, "intermediate_size")
    head_dim = _integer(config, source, "head_dim", default=0) or _head_dim(hidden, heads, source)
    tied = bool(config.get("tie_word_embeddings", False)) if tied_embeddings is None else tied_embeddings
    return ModelShape(
        layers=_integer(config, source, "num_hidden_layers"), hidden=hidden, intermediate=intermediate,
        vocab=_integer(config, source, "vocab_size"), heads=heads,
        kv_heads=_integer(config, source, "num_key_value_heads", default=heads), head_dim=head_dim,
        tied_embeddings=tied, experts=experts, attention_bias=bool(config.get("attention_bias", False)),
        qkv_bias=config.get("model_type") in _QKV_BIAS_TYPES, mlp_bias=bool(config.get("mlp_bias", False)))


def _head_dim(hidden: int, heads: int, source: str) -> int:
    if heads < 1 or hidden % heads:
        raise ConfigError(f"{source}: hidden size {hidden} is not a multiple of the {heads} attention heads; "
                          "give head_dim")
    return hidden // heads


def load_config(path: str | Path) -> dict[str, Any]:
    """A model config file as a dict: JSON, or TOML when the name ends in ``.toml``. Raises
    :class:`ConfigError` naming the file when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the model config: {exc.strerror or exc}", path=str(path)) from exc
    try:
        if path.suffix.lower() == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            loaded: Any = tomllib.loads(text)
        else:
            loaded = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"the model config is not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: "
                          f"{exc}", path=str(path)) from exc
    if not isinstance(loaded, dict):
        raise ConfigError("the model config must hold an object of keys", path=str(path))
    return loaded
