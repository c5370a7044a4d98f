"""One call makes ``sparsecore.torch`` the ``spconv`` that existing code imports: `install_as_spconv`.

Code written for spconv 2.x imports more than ``spconv.pytorch``: mmdetection3d
1.4.0 checks ``spconv.__version__ >= '2.0.0'`` before it uses spconv at all (and
silently falls back to mmcv's spconv-1 operators when the check fails);
OpenPCDet checks ``float(spconv.__version__[2:]) >= 2.2`` and then sets
``spconv.constants.SPCONV_USE_DIRECT_TABLE``; Pointcept imports
``spconv.pytorch`` and reads ``spconv.modules.is_spconv_module``. After
`install_as_spconv` these lines run unedited:

- ``spconv``: a module with ``__version__`` (`StandInVersion`: ``"2.3.8"`` to
  every comparison, slice and version parser, ``"2.3.8+sparsecore"`` when
  printed), ``pytorch``, ``constants`` (spconv's switches: they can be set and
  are ignored), ``core`` (``ConvAlgo``, ``AlgoHint``) and ``STANDIN`` (what it is);
- ``spconv.pytorch`` is ``sparsecore.torch`` itself, and every
  ``spconv.pytorch.<name>`` is ``sparsecore.torch.<name>`` (``utils`` with
  ``PointToVoxel``, ``functional``, ``quantization``, ``conv``, ``modules``,
  ``pool``, ``ops``, ``hash``, ``tables``, ``core``, ...).

Not provided: spconv's top-level ``spconv.utils`` (its voxel generators return
cumm ``tensorview`` arrays; use ``sparsecore.torch.utils.PointToVoxel``) and
its CUDA-only internals (``spconv.core_cc``, ``spconv.algo``).

Example:
    >>> import sparsecore.torch
    >>> sparsecore.torch.install_as_spconv()
    >>> import spconv.pytorch as spconv       # sparsecore.torch
    >>> spconv.SubMConv3d(16, 32, 3, indice_key="subm1")
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["SPCONV_VERSION", "StandInVersion", "install_as_spconv"]

SPCONV_VERSION = "2.3.8"
"""The spconv release whose ``spconv.pytorch`` sparsecore.torch follows (docs/migrating_from_spconv.md)."""

_MARKER = "__sparsecore_standin__"


class StandInVersion(str):
    """spconv's version string as code compares it, saying it is sparsecore when printed.

    The string's value is `SPCONV_VERSION` (``"2.3.8"``), so ``>= "2.0.0"``,
    ``float(v[2:])``, ``packaging.version.parse(v)`` and mmcv's ``digit_version(v)``
    see spconv 2.3.8; ``str(v)``, ``print(v)`` and ``repr(v)`` say
    ``2.3.8+sparsecore`` (a valid local version: it parses the same).

    Attributes:
        implementation: ``"sparsecore <version>"``.
    """

    implementation: str

    def __new__(cls, implementation: str) -> "StandInVersion":
        value = super().__new__(cls, SPCONV_VERSION)
        value.implementation = implementation
        return value

    def __str__(self) -> str:
        return f"{SPCONV_VERSION}+sparsecore"

    def __repr__(self) -> str:
        return repr(str(self))

    def __format__(self, format_spec: str) -> str:
        return format(str(self), format_spec)


def _is_standin(module: Any) -> bool:
    return bool(getattr(module, _MARKER, False))


def install_as_spconv(force: bool = False) -> types.ModuleType:
    """Registers ``sparsecore.torch`` as ``spconv.pytorch`` (and a ``spconv`` package around it) in ``sys.modules``.

    Call it once, before the code that imports spconv is imported. Calling it
    again returns the module already installed.

    Args:
        force: replace a real spconv that this process has already imported
            (its modules stay alive wherever they were bound; new imports get
            sparsecore). Without it, that case is an error.

    Returns:
        The ``spconv`` module now in ``sys.modules``.

    Raises:
        RuntimeError: a real ``spconv`` (or ``spconv.pytorch``) is already imported and
            ``force`` is False.
    """
    import sparsecore
    import sparsecore.torch as frontend
    from sparsecore.torch import core as frontend_core

    existing = sys.modules.get("spconv")
    if existing is not None and _is_standin(existing):
        return existing
    real = sorted(name for name in sys.modules if name == "spconv" or name.startswith("spconv."))
    if real and not force:
        origin = getattr(sys.modules.get(real[0]), "__file__", None) or "an unknown location"
        raise RuntimeError(
            f"install_as_spconv: a real spconv is already imported in this process ({real[0]} from {origin}); "
            "call sparsecore.torch.install_as_spconv() before anything imports spconv, or pass force=True to "
            "replace it for later imports (objects made with the real spconv stay spconv's)"
        )
    for name in real:
        del sys.modules[name]

    package = types.ModuleType("spconv", f"sparsecore {sparsecore.__version__} standing in for spconv "
                                         f"{SPCONV_VERSION} (sparsecore.torch.install_as_spconv).")
    package.__path__ = []  # a package: `import spconv.x` looks in sys.modules only
    package.__version__ = StandInVersion(f"sparsecore {sparsecore.__version__}")
    package.STANDIN = package.__doc__
    setattr(package, _MARKER, True)
    constants = types.ModuleType("spconv.constants", "spconv's switches: accepted and ignored by sparsecore.")
    for switch, value in (("SPCONV_USE_DIRECT_TABLE", True), ("SPCONV_ALLOW_TF32", False),
                          ("SPCONV_DO_SORT", True), ("SPCONV_FX_TRACE_MODE", False)):
        setattr(constants, switch, value)
    core = types.ModuleType("spconv.core", "spconv's algorithm enums (sparsecore.torch.core).")
    core.ConvAlgo, core.AlgoHint = frontend_core.ConvAlgo, frontend_core.AlgoHint
    package.constants, package.core, package.pytorch = constants, core, frontend
    package.ConvAlgo, package.AlgoHint = frontend_core.ConvAlgo, frontend_core.AlgoHint

    aliases = {"spconv": package, "spconv.constants": constants, "spconv.core": core}
    prefix = frontend.__name__  # "sparsecore.torch"
    for name, module in list(sys.modules.items()):
        if module is not None and (name == prefix or name.startswith(prefix + ".")):
            aliases["spconv.pytorch" + name[len(prefix):]] = module
    sys.modules.update(aliases)
    return package
