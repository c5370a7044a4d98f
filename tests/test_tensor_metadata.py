"""sparsecore.torch.tensor_metadata: the configs torch.export.save writes pass, and every view of the stored bytes
that torch would build differently from what was saved is refused naming the key; the extent is checked against
torch.as_strided itself (the oracle of what a view reads)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from sparsecore.torch.tensor_metadata import TensorLayout, check_payload_config  # noqa: E402


def _entry(record: str, dtype: int, sizes, strides, offset: int = 0) -> dict:
    return {"path_name": record, "is_param": True, "use_pickle": False, "tensor_meta": {
        "dtype": dtype, "sizes": [{"as_int": s} for s in sizes], "strides": [{"as_int": s} for s in strides],
        "storage_offset": {"as_int": offset}, "requires_grad": True, "device": {"type": "cpu", "index": None},
        "layout": 7}}


def _config(**entries) -> bytes:
    return json.dumps({"config": entries}).encode()


RECORDS = {"weight_0": 8 * 3 * 4, "weight_1": 8 * 4}


def test_a_config_as_torch_writes_it_passes() -> None:
    layouts = check_payload_config("c", _config(w=_entry("weight_0", 7, [8, 1, 3], [3, 3, 1]),
                                                b=_entry("weight_1", 7, [8], [1])), RECORDS)
    assert [layout.key for layout in layouts] == ["w", "b"]
    check_payload_config("c", _config(), {})  # no tensors


@pytest.mark.parametrize("sizes, strides, offset", [([8, 3], [3, 1], 0), ([2, 3], [1, 2], 4), ([4, 1, 2], [6, 0, 3], 1),
                                                     ([0, 5], [5, 1], 0)])
def test_the_extent_is_what_as_strided_reads(sizes, strides, offset) -> None:
    layout = TensorLayout("k", "r", torch.float32, tuple(sizes), tuple(strides), offset)
    storage = torch.arange(100, dtype=torch.float32)
    view = torch.as_strided(storage, sizes, strides, offset)
    assert layout.extent == (int(view.max()) + 1 if view.numel() else 0)


@pytest.mark.parametrize("entries, message", [
    ({"w": _entry("weight_0", 7, [8, 3], [0, 1])}, "gives 'w' the stride 0 on axis 0 of 8 elements"),
    ({"w": _entry("weight_0", 6, [8, 3], [3, 1])}, "reads 24 of the 48 torch.float16 elements of the record 'weight_0'"),
    ({"w": _entry("weight_0", 7, [8, 4], [4, 1])}, "views 'w' as sizes \\[8, 4\\].*past the end of its record"),
    ({"w": _entry("weight_0", 7, [8, 3], [3, 1], 1)}, "past the end of its record"),
    ({"v": _entry("weight_0", 7, [24], [1]), "w": _entry("weight_1", 7, [8, 3], [3, 1])},
     "past the end of its record 'weight_1'"),
    ({"b": _entry("weight_1", 7, [8], [1]), "w": _entry("weight_0", 7, [8, 3], [3, 1])},
     "gives 'b' the record 'weight_1' where torch.export.save writes 'weight_0'"),
    ({"w": _entry("weight_9", 7, [8], [1])}, "names the record 'weight_9' for 'w', which the archive does not hold"),
    ({"w": _entry("weight_0", 99, [8], [1])}, "gives 'w' the dtype code 99"),
    ({"w": {**_entry("weight_0", 7, [24], [1]), "use_pickle": True}}, "holds pickled tensors \\['w'\\]"),
    ({"w": _entry("weight_0", 7, [-1], [1])}, "non-negative ints"),
    ({"w": _entry("weight_0", 7, [24], [1]), "v": _entry("weight_0", 3, [48], [1])}, "with several dtypes"),
    ({"w": _entry("weight_0", 5, [3], [1])}, "the bytes are not a whole number of elements|reads 3 of the"),
])
def test_a_view_other_than_the_stored_bytes_is_refused_naming_the_key(entries: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_payload_config("model_weights_config.json", _config(**entries), RECORDS)


def test_an_empty_record_for_a_tensor_with_elements_is_refused() -> None:
    with pytest.raises(ValueError, match="gives 'w' sizes \\[1000000000\\] but its record 'weight_0' is empty|past"):
        check_payload_config("c", _config(w=_entry("weight_0", 7, [10**9], [1])), {"weight_0": 0})
    with pytest.raises(ValueError, match="is not the JSON torch.export.save writes"):
        check_payload_config("c", b"{not json", RECORDS)
