"""The algorithm registries use the project's one mechanism (`nexrl.registry`)."""

from nexrl.registry import Registry, RegistryError, check_kwargs, import_object

__all__ = ["Registry", "RegistryError", "check_kwargs", "import_object"]
