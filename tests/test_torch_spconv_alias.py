"""sparsecore.torch.install_as_spconv: the import and version-check lines of OpenPCDet, mmdetection3d and Pointcept.

Each codebase's own lines (quoted as the codebase has them, source named in a comment) run in a
fresh process after the one call; the oracle is what those lines decide (mmdetection3d's
IS_SPCONV2_AVAILABLE, OpenPCDet's version branch), the identity of what they import (sparsecore.torch's
own classes), and a SubMConv3d built through the alias against a dense float64 convolution.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

INSTALL = "import sparsecore.torch\nsparsecore.torch.install_as_spconv()\n"

# Each codebase's lines in its own function (their imports bind locals), all in one fresh process.
SCRIPT = INSTALL + r'''
def section_mmdetection3d():
    import sparsecore.torch as frontend

    # mmdetection3d v1.4.0, mmdet3d/models/layers/spconv/overwrite_spconv/write_spconv2.py (register_spconv2),
    # its import lines; the MODELS registry calls are left out (mmengine is not installed here)
    def register_spconv2():
        try:
            from spconv.pytorch import (SparseConv2d, SparseConv3d, SparseConv4d,
                                        SparseConvTranspose2d,
                                        SparseConvTranspose3d, SparseInverseConv2d,
                                        SparseInverseConv3d, SparseModule,
                                        SubMConv2d, SubMConv3d, SubMConv4d)
        except ImportError:
            return False
        else:
            SparseModule._version = 2
            return True

    # mmdetection3d v1.4.0, mmdet3d/models/layers/spconv/__init__.py
    try:
        import spconv
    except ImportError:
        IS_SPCONV2_AVAILABLE = False
    else:
        if hasattr(spconv, '__version__') and spconv.__version__ >= '2.0.0':
            IS_SPCONV2_AVAILABLE = register_spconv2()
        else:
            IS_SPCONV2_AVAILABLE = False
    assert IS_SPCONV2_AVAILABLE

    # mmdetection3d v1.4.0: layers/sparse_block.py, middle_encoders/sparse_encoder.py and sparse_unet.py,
    # roi_heads/bbox_heads/parta2_bbox_head.py, backbones/minkunet_backbone.py
    if IS_SPCONV2_AVAILABLE:
        from spconv.pytorch import SparseConvTensor, SparseModule, SparseSequential
        from spconv.pytorch import SparseConvTensor, SparseSequential
        from spconv.pytorch import (SparseConvTensor, SparseMaxPool3d,
                                    SparseSequential)
        from spconv.pytorch import SparseConvTensor
    assert SparseConvTensor is frontend.SparseConvTensor and SparseMaxPool3d is frontend.SparseMaxPool3d
    assert SparseModule is frontend.SparseModule and SparseModule._version == 2
    print("version", spconv.__version__)


def section_openpcdet():
    import torch.nn as nn
    import sparsecore.torch as frontend

    # OpenPCDet, pcdet/utils/spconv_utils.py
    import spconv
    if float(spconv.__version__[2:]) >= 2.2:
        spconv.constants.SPCONV_USE_DIRECT_TABLE = False

    try:
        import spconv.pytorch as spconv
    except:
        import spconv as spconv

    assert spconv is frontend
    # OpenPCDet, pcdet/utils/spconv_utils.py: find_all_spconv_keys and replace_feature test these
    layer = spconv.SubMConv3d(4, 8, 3, bias=False, indice_key="subm1")
    assert isinstance(layer, spconv.conv.SparseConvolution) and not isinstance(nn.ReLU(), spconv.conv.SparseConvolution)
    import torch
    x = spconv.SparseConvTensor(torch.ones(2, 4), torch.tensor([[0, 0, 0, 0], [0, 1, 1, 1]], dtype=torch.int32),
                                [4, 4, 4], 1)
    assert "replace_feature" in x.__dir__()
    print("sorted branch ok")


def section_pointcept():
    import numpy as np
    import torch
    import sparsecore.torch as frontend

    # Pointcept, pointcept/models/sparse_unet/spconv_unet_v1m2_bn_momentum.py
    try:
        import spconv.pytorch as spconv
    except ImportError:
        import warnings

        warnings.warn("Please follow `README.md` to install spconv2.`")
    # Pointcept, pointcept/models/modules.py and sparse_unet/spconv_unet_v1m1_base.py use these names
    assert spconv.modules.is_spconv_module(spconv.SubMConv3d(1, 1, 3))
    assert spconv.SparseInverseConv3d is frontend.SparseInverseConv3d and spconv.Identity is frontend.Identity
    from spconv.pytorch import functional, quantization, utils
    assert spconv.utils.PointToVoxel is frontend.utils.PointToVoxel

    # a layer built through the alias against the dense float64 convolution of the densified input
    rng = np.random.default_rng(7)
    sites = rng.choice(6 * 6 * 6, size=40, replace=False)
    coords = np.stack(np.unravel_index(sites, (6, 6, 6)), axis=1)
    indices = torch.from_numpy(np.concatenate([np.zeros((40, 1)), coords], axis=1).astype(np.int32))
    features = torch.from_numpy(rng.standard_normal((40, 3)))
    layer = spconv.SubMConv3d(3, 5, 3, bias=False).double()
    out = layer(spconv.SparseConvTensor(features=features, indices=indices, spatial_shape=[6, 6, 6],
                                        batch_size=1))
    dense = torch.zeros(1, 3, 6, 6, 6, dtype=torch.float64)
    dense[0, :, coords[:, 0], coords[:, 1], coords[:, 2]] = features.T
    weight = layer.weight.detach().permute(0, 4, 1, 2, 3)  # [out, k, k, k, in] -> [out, in, k, k, k]
    reference = torch.nn.functional.conv3d(dense, weight, padding=1)[0]
    expected = reference[:, coords[:, 0], coords[:, 1], coords[:, 2]].T
    got = out.features.detach()
    order = [np.flatnonzero((out.indices.numpy() == row).all(axis=1))[0] for row in indices.numpy()]
    assert torch.allclose(got[order], expected, atol=1e-12), float((got[order] - expected).abs().max())
    print("dense ok")


def section_version():
    import spconv
    from packaging.version import Version
    assert spconv.__version__ == "2.3.8" and Version(spconv.__version__) >= Version("2.0.0")
    assert Version(str(spconv.__version__)) == Version("2.3.8+sparsecore")
    assert "sparsecore" in spconv.__version__.implementation and "sparsecore" in spconv.__doc__
    assert sparsecore.torch.install_as_spconv() is spconv  # a second call returns the installed module
    try:
        import spconv.utils  # spconv's cumm-based utilities are not provided: a plain ImportError
    except ImportError as error:
        print("missing", error.name)
    print(spconv.__version__, repr(spconv.__version__))


def section_refusal():
    import sys
    import types
    real = types.ModuleType("spconv")
    real.__file__ = "/site-packages/spconv/__init__.py"
    sys.modules["spconv"] = real  # stands for a real spconv imported before the call (spconv may be absent here)
    try:
        sparsecore.torch.install_as_spconv()
    except RuntimeError as error:
        print("refused:", error)
    installed = sparsecore.torch.install_as_spconv(force=True)
    import spconv
    assert spconv is installed and spconv is not real and spconv.pytorch is sparsecore.torch
    print("forced")


import traceback
for name, section in [(n[len("section_"):], f) for n, f in list(globals().items()) if n.startswith("section_")]:
    try:
        section()
        print("PASS", name)
    except BaseException:
        print("FAIL", name, traceback.format_exc().replace("\n", " | "))
'''


@pytest.fixture(scope="module")
def output() -> str:
    completed = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


def _passed(output: str, name: str) -> None:
    failures = [line for line in output.splitlines() if line.startswith(f"FAIL {name} ")]
    assert not failures and f"PASS {name}" in output.splitlines(), failures or output


def test_mmdetection3d_checks_and_imports(output: str) -> None:
    _passed(output, "mmdetection3d")
    assert "version 2.3.8+sparsecore" in output


def test_openpcdet_checks_and_imports(output: str) -> None:
    _passed(output, "openpcdet")
    assert "sorted branch ok" in output


def test_pointcept_imports_and_a_layer_matches_a_dense_convolution(output: str) -> None:
    _passed(output, "pointcept")
    assert "dense ok" in output


def test_the_version_says_sparsecore_and_parses_as_spconv(output: str) -> None:
    _passed(output, "version")
    assert "missing spconv.utils" in output and "2.3.8+sparsecore '2.3.8+sparsecore'" in output


def test_a_real_spconv_already_imported_is_refused_unless_forced(output: str) -> None:
    _passed(output, "refusal")
    assert "refused: install_as_spconv: a real spconv is already imported" in output
    assert "force=True" in output and "forced" in output
