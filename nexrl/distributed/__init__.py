"""Ray mode: resource manager, virtual cluster, worker groups and the Ray system.

`execute` lives in `nexrl.execute` (below every module); it is re-exported here
for code written against the seed's `nexrl.distributed` import.
"""

from nexrl.execute import ModuleDiedError, execute, execute_async, resolve

__all__ = ["ModuleDiedError", "execute", "execute_async", "resolve"]
