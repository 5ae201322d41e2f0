"""The C kernels' descriptors (kernel/cpu/layout.py): laid out once, filled by field name, the same layout on
both sides of ctypes."""

import pytest

from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel.cpu import build, layout
from minisgl.kernel.cpu.layout import Descriptor


def test_offsets_follow_the_fields_in_order_nested_descriptors_inlined():
    """Hand count: a part is 5 words, a linear 2 + 3 parts = 17, a layer 6 words, four linears, the window,
    the router (a linear) and 5 words of a sparse layer = 97."""
    assert (layout.PART.words, layout.LINEAR.words, layout.LAYER.words) == (5, 17, 97)
    assert layout.LINEAR["part"] == 2
    assert layout.LAYER["qkv"] == 6 and layout.LAYER["down"] == 6 + 3 * 17
    assert (
        layout.LAYER["window"] == 74 and layout.LAYER["router"] == 75 and layout.LAYER["expert_inter"] == 96
    )
    assert layout.EXPERT["down"] == 6 and layout.EXPERT.words == 9


def test_a_descriptor_is_filled_by_name_and_nested_descriptors_land_at_their_offset():
    part = Descriptor(layout.PART, kind=layout.PART_STORED, type=12, data=1000, row_bytes=144, rows=7)
    lin = Descriptor(layout.LINEAR, parts=2, bias=55)
    lin["part", 1] = part
    assert lin.words == [2, 55, *[0] * 5, 1, 12, 1000, 144, 7, *[0] * 5]
    layer = Descriptor(layout.LAYER, window=4096)
    layer["o"] = lin
    assert (
        layer.words[23:40] == lin.words
        and layer.words[74] == 4096
        and sum(layer.words) == 4096 + sum(lin.words)
    )


def test_a_wrong_field_name_index_or_kind_fails_naming_it():
    d = Descriptor(layout.MODEL)
    with pytest.raises(KeyError, match="'hiden'.*hidden"):
        d["hiden"] = 896
    with pytest.raises(IndexError, match="LIN_PART holds 3"):
        Descriptor(layout.LINEAR)["part", 3] = Descriptor(layout.PART)
    with pytest.raises(TypeError, match="takes a LIN descriptor"):
        Descriptor(layout.LAYER)["qkv"] = Descriptor(layout.PART)
    with pytest.raises(TypeError, match="one word"):
        d["hidden"] = Descriptor(layout.PART)


def test_the_generated_header_defines_every_offset_and_length():
    header = layout.c_header()
    assert "#define LAYER_WINDOW 74\n" in header and "#define LAYER_WORDS 97\n" in header
    assert "#define MODEL_MOE_INTS 17\n" in header and "#define LIN_PART_COUNT 3\n" in header
    assert f'#define LAYOUT_SIGNATURE "{layout.signature()}"' in header


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: CPU kernels not built")
def test_a_library_built_for_another_layout_is_refused_at_load(monkeypatch):
    path = build.build()
    assert build.load(path) is not None  # the layout it was built with
    monkeypatch.setattr(layout, "signature", lambda: "0123456789abcdef")
    with pytest.raises(RuntimeError, match="built for descriptor layout .* describes 0123456789abcdef"):
        build.load(path)
