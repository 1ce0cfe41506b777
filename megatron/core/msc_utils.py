"""Multi-Storage Client switch (upstream's ``megatron.core.msc_utils``): ``MultiStorageClientFeature`` is off by
default; ``enable()`` turns it on, but it only takes effect where the ``multistorageclient`` package is installed
(``is_enabled()``). This fork reads and writes local filesystems only; ``import_package()`` names what is missing."""
import importlib
from typing import Any


class _FeatureFlag:
    def __init__(self, default: bool = False):
        self._enabled = default

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def is_enabled(self) -> bool:
        """On and the package importable."""
        if not self._enabled:
            return False
        try:
            importlib.import_module("multistorageclient")
        except ImportError:
            return False
        return True

    def import_package(self) -> Any:
        """The ``multistorageclient`` module (RuntimeError when the feature is off or the package is absent)."""
        if not self._enabled:
            raise RuntimeError("MultiStorageClientFeature is disabled: call MultiStorageClientFeature.enable() first")
        try:
            return importlib.import_module("multistorageclient")
        except ImportError as err:
            raise RuntimeError("MultiStorageClientFeature: the multistorageclient package is not installed") from err


MultiStorageClientFeature = _FeatureFlag()
