"""A Hugging Face checkpoint's weights into the decoder's sharded state, tensor by tensor.

``load_pretrained(config, mesh)`` is ``init_model``'s counterpart for ``model.from_pretrained``:
the same (graphdef, state), each weight made with ``jax.make_array_from_callback`` in the
shardings of ``state_shardings``, so that every device receives only its shard and no device
(nor the host) ever holds the whole model: a shard's callback reads the checkpoint tensors of
the layers and experts in its index (safetensors reads one tensor at a time from the file's
memory map), converts each (``weights.Rule``) and cuts its slice. An expert's tensors are
read by the one device that holds the expert; an FSDP-sharded weight's tensor is read whole by
each device, which keeps its slice (host reads grow with the device count, host memory does
not: reading only the slice through safetensors' ``get_slice`` is left to do).

Every tensor is checked before use: a missing one, or one of the wrong shape, is an error naming
it; so is a tensor that no weight takes (a bias the model lacks, say), which would otherwise be
dropped silently.

gpt-oss's official checkpoints store the experts in MXFP4 (``{name}_blocks`` and
``{name}_scales`` for the tensor ``name``): read in their place and dequantized exactly, as
transformers' ``convert_moe_packed_tensors`` does (``dequantize_mxfp4``), the device's experts'
rows only.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from peakflat_jax import mesh as mop
from peakflat_jax.config import ConfigError, ModelConfig
from peakflat_jax.hf.config import model_config_from_hf, read_hf_config
from peakflat_jax.hf.weights import IGNORED_SUFFIXES, Rule, layer_offset, rules


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not make the configured model; names the tensor."""


MXFP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
"""The 16 FP4 (e2m1) values, by code."""


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 ``blocks [E, out, G, 16]`` uint8 (two FP4 codes a byte, the low nibble first) and
    ``scales [E, out, G]`` uint8 (a power of two per 32 values, exponent bias 127) as the
    float32 tensor ``[E, in = 32 G, out]`` (exact: FP4 values times powers of two)."""
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = MXFP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = MXFP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)


class SafetensorsCheckpoint:
    """The tensors of a directory's ``*.safetensors`` files (one, or the shards of a
    ``model.safetensors.index.json``), read one at a time."""

    def __init__(self, directory: str | pathlib.Path):
        from safetensors import safe_open  # a dependency of this package only where used

        self._open = safe_open
        self.directory = pathlib.Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"model.from_pretrained: no *.safetensors file in "
                                  f"{str(directory)!r}")
        self.files: dict[str, pathlib.Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="numpy") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    if name in self.files:
                        raise CheckpointError(f"{name}: in both {self.files[name].name} and "
                                              f"{file.name}")
                    self.files[name] = file
                    self.shapes[name] = tuple(view.get_shape())
                    self.dtypes[name] = view.get_dtype()

    def stored_names(self, name: str) -> list[str]:
        """The checkpoint's tensors that hold ``name``: itself, or its MXFP4 blocks and
        scales."""
        packed = [f"{name}_blocks", f"{name}_scales"]
        if name not in self.files and all(p in self.files for p in packed):
            return packed
        return [name]

    def tensor(self, name: str, shape: tuple[int, ...], rows: slice | None = None) -> np.ndarray:
        """The tensor ``name``, checked to have ``shape``; ``rows``: only those of its first
        axis (read through the file's memory map: a device reads its experts' rows of a
        tensor that holds every expert)."""
        if self.stored_names(name) != [name]:
            return self._mxfp4(name, shape, rows)
        if name not in self.files:
            raise CheckpointError(f"{name}: missing from the checkpoint in {self.directory}")
        if self.shapes[name] != shape:
            raise CheckpointError(f"{name}: shape {self.shapes[name]} in the checkpoint, "
                                  f"expected {shape}")
        if self.dtypes[name] == "BF16":
            return self._bfloat16(name, rows)
        with self._open(self.files[name], framework="numpy") as handle:
            if rows is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[rows]

    def _mxfp4(self, name: str, shape: tuple[int, ...], rows: slice | None) -> np.ndarray:
        """The [E, in, out] tensor ``name`` from its MXFP4 blocks and scales, checked to make
        ``shape``."""
        blocks, scales = self.stored_names(name)
        experts, inputs, outputs = shape
        for stored, expected, dtype in ((blocks, (experts, outputs, inputs // 32, 16), "U8"),
                                        (scales, (experts, outputs, inputs // 32), "U8")):
            if inputs % 32 or self.shapes[stored] != expected or self.dtypes[stored] != dtype:
                raise CheckpointError(f"{stored}: {self.dtypes[stored]} of shape "
                                      f"{self.shapes[stored]} in the checkpoint, expected "
                                      f"{dtype} {expected} (MXFP4 of {shape})")
        rows = slice(None) if rows is None else rows
        with self._open(self.files[blocks], framework="numpy") as handle:
            packed = handle.get_slice(blocks)[rows]
        with self._open(self.files[scales], framework="numpy") as handle:
            exponents = handle.get_slice(scales)[rows]
        return dequantize_mxfp4(packed, exponents)

    def _bfloat16(self, name: str, rows: slice | None) -> np.ndarray:
        """A bf16 tensor through the file's header: safetensors' numpy side has no bfloat16,
        the bytes are ml_dtypes' (jnp.bfloat16)."""
        path = self.files[name]
        with open(path, "rb") as file:
            header_bytes = int.from_bytes(file.read(8), "little")
            entry = json.loads(file.read(header_bytes))[name]
        start, end = entry["data_offsets"]
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_bytes + start,
                         shape=(end - start,))
        value = data.view(jnp.bfloat16).reshape(entry["shape"])
        return np.asarray(value if rows is None else value[rows])


def _index_key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _leaf_array(rule: Rule, config: ModelConfig, checkpoint: SafetensorsCheckpoint,
                shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    """One of our weights, each device's shard read from the checkpoint (module doc)."""
    offset = layer_offset(config, rule.path)
    vocab_axis = {("embedding",): 0, ("head",): 1}.get(rule.path)
    built: dict[tuple, np.ndarray] = {}  # replicated shards are read once

    def piece(layer: int | None, expert: int | None, rows: slice | None = None) -> np.ndarray:
        name = rule.name.format(layer=None if layer is None else layer + offset, expert=expert)
        value = rule.to_ours(checkpoint.tensor(name, rule.hf_shape, rows))
        if vocab_axis is not None and value.shape[vocab_axis] < shape[vocab_axis]:
            padding = [(0, 0)] * value.ndim  # padded vocab entries: zero, never in a softmax
            padding[vocab_axis] = (0, shape[vocab_axis] - value.shape[vocab_axis])
            value = np.pad(value, padding)
        return value

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        key = _index_key(index)
        if key in built:
            return built[key]
        lead = 0
        if rule.stacked:
            layers = range(shape[0])[index[0]]
            lead = 1
        if rule.has_expert_axis:
            experts = range(shape[1])[index[1]]
            lead = 2
        rest = index[lead:]
        if rule.per_expert:
            value = np.stack([np.stack([piece(i, e)[rest] for e in experts]) for i in layers])
        elif rule.experts_in_tensor:  # this shard's experts' rows of each layer's tensor
            rows = slice(experts.start, experts.stop, experts.step)
            value = np.stack([piece(i, None, rows)[(slice(None), *rest)] for i in layers])
        elif rule.stacked:
            value = np.stack([piece(i, None)[rest] for i in layers])
        else:
            value = piece(None, None)[rest]
        built[key] = value = np.ascontiguousarray(value.astype(dtype))
        return value

    return jax.make_array_from_callback(shape, sharding, shard)


def check_architecture(config: ModelConfig) -> dict:
    """The checkpoint's parsed config.json, once ``config``'s architecture is checked to be
    that checkpoint's (``load_config`` reads it in: ``resolve_pretrained``)."""
    hf = read_hf_config(config.from_pretrained)
    expected = model_config_from_hf(hf, config)
    if expected != config:
        different = [f for f in expected.__dataclass_fields__
                     if getattr(expected, f) != getattr(config, f)]
        raise ConfigError(f"model.{different[0]}: {getattr(config, different[0])!r}, but "
                          f"model.from_pretrained's config.json gives "
                          f"{getattr(expected, different[0])!r} (load the config with "
                          f"load_config, which reads it in)")
    return hf


def load_pretrained(config: ModelConfig, mesh: Mesh):
    """(graphdef, state) of the decoder with ``config.from_pretrained``'s weights, placed in
    their shards (module doc). The router's balancing bias is zero."""
    from peakflat_jax.model.decoder import MoEDecoder
    from peakflat_jax.model.sharding import state_shardings

    hf = check_architecture(config)
    family = hf["model_type"]
    checkpoint = SafetensorsCheckpoint(config.from_pretrained)
    padded = mop.padded_vocab(config.vocab_size, mop.num_devices(mesh))
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: MoEDecoder(config, padded_vocab=padded, rngs=nnx.Rngs(0))))
    shardings = state_shardings(abstract, mesh)
    by_path = {rule.path: rule for rule in rules(config, family)}
    used = {"lm_head.weight"} if config.tie_embeddings else set()  # tied: may be saved
    for rule in by_path.values():  # the names the rules read, for the unused check
        offset = layer_offset(config, rule.path)
        count = (config.num_dense_layers if rule.path[0] == "dense_layers" else
                 config.num_layers - config.num_dense_layers)
        layers = range(offset, offset + count) if rule.stacked else [None]
        experts = range(config.num_experts) if rule.per_expert else [None]
        used |= {stored for i in layers for e in experts
                 for stored in checkpoint.stored_names(rule.name.format(layer=i, expert=e))}
    unused = sorted(n for n in set(checkpoint.files) - used if not n.endswith(IGNORED_SUFFIXES))
    if unused:
        raise CheckpointError(f"{unused[0]}: a checkpoint tensor that no weight of the model "
                              f"takes ({len(unused)} such)")

    def make(path, leaf, sharding):
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        names = names[:-1] if names[-1] == "value" else names
        if names[-1] == "router_bias":
            return jax.device_put(jnp.zeros(leaf.shape, leaf.dtype), sharding)
        rule = by_path.get(names)
        if rule is None:  # a bug: a weight of the model without a rule
            raise CheckpointError(f"{'.'.join(names)}: no checkpoint tensor maps to it")
        return _leaf_array(rule, config, checkpoint, leaf.shape, leaf.dtype, sharding)

    state = jax.tree_util.tree_map_with_path(make, abstract, shardings)
    return graphdef, state



def init_or_load(config: ModelConfig, mesh: Mesh, seed: int):
    """(graphdef, state): ``model.sharding.init_model``'s, or where ``config.from_pretrained``
    is set, the checkpoint's weights read into the same shardings (``load_pretrained``; the seed
    unused)."""
    if config.from_pretrained is not None:
        return load_pretrained(config, mesh)
    from peakflat_jax.model.sharding import init_model

    return init_model(config, mesh, seed)
