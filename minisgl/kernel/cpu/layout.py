"""The int64 descriptors the C kernels read (decode_step.c's model, layers and linear layers; moe.c's stored
experts), each field named once, here. The build writes them into a generated C header (`layout.h`: one
`#define` a field's word offset, one a descriptor's length, and the shared constants) that the C files include;
the library reports that header's signature, checked when it loads. Python fills a descriptor by field name
(`Descriptor`), never by list position.

A field holds one int64 word (a size, a count or an address), or a nested descriptor (`("qkv", LINEAR)`), or
several in a row (`("part", PART, 3)`)."""

from __future__ import annotations

import hashlib
import textwrap
from collections.abc import Iterable

import torch

Field = str | tuple[str, "Layout"] | tuple[str, "Layout", int]


class Layout:
    """One descriptor's fields in order: their word offsets and the total length; `prefix` names them in C
    (field `hidden` of MODEL is `MODEL_HIDDEN`)."""

    def __init__(self, prefix: str, doc: str, *fields: Field) -> None:
        self.prefix, self.doc = prefix, doc
        self.fields: dict[str, tuple[int, Layout | None, int]] = {}  # name -> (offset, nested, count)
        offset = 0
        for f in fields:
            if isinstance(f, str):
                name, sub, count = f, None, 1
            else:
                name, sub, count = f[0], f[1], f[2] if len(f) > 2 else 1
            assert name not in self.fields, f"{prefix}: field {name} twice"
            self.fields[name] = (offset, sub, count)
            offset += count * (sub.words if sub is not None else 1)
        self.words = offset

    def __getitem__(self, name: str) -> int:
        """The word offset of a field."""
        return self._field(name)[0]

    def count(self, name: str) -> int:
        """How many of a field the descriptor holds in a row."""
        return self._field(name)[2]

    def _field(self, name: str) -> tuple[int, Layout | None, int]:
        if name not in self.fields:
            raise KeyError(
                f"the {self.prefix} descriptor has no field {name!r} (fields: {', '.join(self.fields)})"
            )
        return self.fields[name]

    def c_lines(self) -> list[str]:
        """The header's lines for this descriptor: its fields' offsets, then its length."""
        doc = textwrap.wrap(f"/* {self.doc} */", 110)
        lines = [doc[0], *(" * " + line for line in doc[1:])]
        for name, (offset, sub, count) in self.fields.items():
            what = f" /* {count} x {sub.prefix}_WORDS */" if count > 1 else ""
            lines.append(f"#define {self.prefix}_{name.upper()} {offset}{what}")
            if count > 1:
                lines.append(f"#define {self.prefix}_{name.upper()}_COUNT {count}")
        lines.append(f"#define {self.prefix}_WORDS {self.words}")
        return lines


class Descriptor:
    """One descriptor's words, all 0 (none, absent) until set by field name: `d["hidden"] = 896`, a nested
    descriptor `d["qkv"] = linear`, one of several `d["part", 1] = part`."""

    def __init__(self, layout: Layout, **values: int | Descriptor) -> None:
        self.layout = layout
        self.words = [0] * layout.words
        for name, value in values.items():
            self[name] = value

    def __setitem__(self, key: str | tuple[str, int], value: int | Descriptor) -> None:
        name, index = (key, 0) if isinstance(key, str) else key
        offset, sub, count = self.layout._field(name)
        if not 0 <= index < count:
            raise IndexError(f"{self.layout.prefix}_{name.upper()} holds {count}, not index {index}")
        if sub is None:
            if isinstance(value, Descriptor):
                raise TypeError(f"{self.layout.prefix}_{name.upper()} is one word, not a descriptor")
            self.words[offset + index] = int(value)
            return
        if not isinstance(value, Descriptor) or value.layout is not sub:
            raise TypeError(f"{self.layout.prefix}_{name.upper()} takes a {sub.prefix} descriptor")
        start = offset + index * sub.words
        self.words[start : start + sub.words] = value.words

    def tensor(self) -> torch.Tensor:
        """The words as the int64 tensor the C code reads."""
        return torch.tensor(self.words, dtype=torch.int64)


def stack(descs: Iterable[Descriptor]) -> torch.Tensor:
    """Descriptors of one layout, one after another: int64 [n, words]."""
    return torch.tensor([d.words for d in descs], dtype=torch.int64)


# ---- the shared constants -------------------------------------------------------------------------------
PANEL_ROWS = 16  # weight rows a panel of a packed float32 weight (gemm.c's NR)
Q8_BLOCK_BYTES = 84  # bytes a block of 32 activations quantized for the int8 dot takes (q8.h's xgroup)
PART_PACKED, PART_STORED = 0, 1  # PART's kind: float32 panels (pack_weight_f32), GGUF rows as stored
EMBED_STORED, EMBED_F32 = 1, 2  # MODEL's embed_kind: GGUF rows as stored, float32 rows
CONSTANTS = {  # C name: (value, what)
    "LAYOUT_PANEL_ROWS": (PANEL_ROWS, "weight rows a panel of a packed float32 weight"),
    "LAYOUT_Q8_BLOCK_BYTES": (Q8_BLOCK_BYTES, "bytes a block of 32 quantized activations (xgroup) takes"),
    "PART_PACKED": (PART_PACKED, "PART_KIND: float32 panels (pack_weight_f32)"),
    "PART_STORED": (PART_STORED, "PART_KIND: GGUF rows as stored"),
    "EMBED_STORED": (EMBED_STORED, "MODEL_EMBED_KIND: GGUF rows as stored"),
    "EMBED_F32": (EMBED_F32, "MODEL_EMBED_KIND: float32 rows"),
}

# ---- the descriptors ------------------------------------------------------------------------------------
STORED = Layout(
    "STORED", "a GGUF weight as stored: its GGML type, data address, row bytes", "type", "data", "row_bytes"
)
EXPERT = Layout(
    "EXPERT",
    "a sparse layer's expert (moe_stored_f32 takes E of them): its gate [I, H], up [I, H], down [H, I]",
    ("gate", STORED),
    ("up", STORED),
    ("down", STORED),
)
PART = Layout(
    "PART",
    "a part of a linear layer's weight: kind (PART_PACKED: data is float32 panels; PART_STORED: GGUF rows of "
    "type, row_bytes apart), data, its output rows",
    "kind",
    "type",
    "data",
    "row_bytes",
    "rows",
)
LINEAR = Layout(
    "LIN",
    "a linear layer: its weight's parts, stacked along the output (parts used, their descriptors), its float32 "
    "bias (0: none)",
    "parts",
    "bias",
    ("part", PART, 3),
)
LAYER = Layout(
    "LAYER",
    "a decoder layer: its norms' float32 weights (q_norm, k_norm: 0 without), KV cache, linear layers, the "
    "attention window (0: full); a sparse layer's router, experts, top k, renormalize (0/1), experts' "
    "descriptor (E x EXPERT_WORDS; 0: a dense layer) and intermediate size",
    "input_norm",
    "post_norm",
    "q_norm",
    "k_norm",
    "k_cache",
    "v_cache",
    ("qkv", LINEAR),
    ("o", LINEAR),
    ("gate_up", LINEAR),
    ("down", LINEAR),
    "window",
    ("router", LINEAR),
    "experts",
    "top_k",
    "renormalize",
    "expert_desc",
    "expert_inter",
)
MODEL = Layout(
    "MODEL",
    "the model: its shape (layers, hidden, heads, head dim, dense intermediate size, rotary dims), cos|sin "
    "table, final norm, page table (int32) and its row stride, the embedding (EMBED_*, GGML type, data, row "
    "bytes), int8 mode (1: the int8-activation dot), the sparse layers' scratch (floats, int64)",
    "layers",
    "hidden",
    "q_heads",
    "kv_heads",
    "head_dim",
    "inter",
    "rot",
    "cos_sin",
    "final_norm",
    "page_table",
    "page_table_stride",
    "embed_kind",
    "embed_type",
    "embed_data",
    "embed_row_bytes",
    "int8",
    "moe_floats",
    "moe_ints",
)
LAYOUTS = (STORED, EXPERT, PART, LINEAR, LAYER, MODEL)


def _body() -> list[str]:
    lines = [f"#define {name} {value} /* {doc} */" for name, (value, doc) in CONSTANTS.items()]
    for layout in LAYOUTS:
        lines += ["", *layout.c_lines()]
    return lines


def signature() -> str:
    """A digest of every offset and constant: the library built from this layout reports the same."""
    return hashlib.sha256("\n".join(_body()).encode()).hexdigest()[:16]


def c_header() -> str:
    """layout.h, generated at build time into the build directory."""
    return "\n".join(
        [
            "/* Generated from minisgl/kernel/cpu/layout.py at build time (edit that file, not this one): the",
            " * descriptors' word offsets and lengths and the constants Python and C share. */",
            "#ifndef MINISGL_CPU_LAYOUT_H",
            "#define MINISGL_CPU_LAYOUT_H",
            "",
            f'#define LAYOUT_SIGNATURE "{signature()}"',
            *_body(),
            "",
            "#endif",
            "",
        ]
    )
