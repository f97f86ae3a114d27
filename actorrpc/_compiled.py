"""Which of actorrpc's modules run compiled (mypyc) in this process.

``ACTORRPC_COMPILE=1 pip install ...`` compiles the per-message path (``setup.py``'s
``COMPILED_MODULES``) with mypyc; the same sources run as pure Python otherwise. Compiled
code keeps these rules, which the pure-Python build does not need:

- Arguments are checked against their annotations at the call: a parameter typed with
  one of our classes rejects a stand-in (tests marked ``internals`` run on the
  pure-Python build only), and a callback torch calls gets ``torch._C.Future``, not the
  Python subclass. Public functions stay in Python modules, so that a user's wrong
  argument meets our own error and ``help()`` finds the docstring (compiled functions
  carry none).
- Classes are native (fixed attributes, no weak references, methods not replaceable on
  an instance) unless marked ``@mypyc_attr(native_class=False)``: subclasses of
  ``threading.local``, ``bytearray`` and ``pickle.Pickler``, and ``Transport`` (a
  ``weakref.finalize`` closes its nudge pipe).
- torch, pyzmq, dill and numpy are typed as ``Any`` in the compiled build (setup.py
  passes ``--no-site-packages``: one program wherever it is built), so a class deriving
  from one of theirs must live in a Python module: ``autograd/_nodes.py`` (torch's
  ``FunctionMeta`` makes the nodes' classes). Type aliases of their types are declared
  under ``TYPE_CHECKING`` with ``TypeAlias``.
- An attribute assigned ``None`` and read again in one function is taken to be ``None``
  still, whatever a call in between did to it (mypy's narrowing, checked at run time):
  assign a name typed with the wider type instead (``_pickling._NO_TARGET``).
- ``@dataclass``'s generated methods run interpreted: classes made per message have an
  explicit ``__init__``.
- Compiled code holds no reference of its own to ``self`` or a closure's cells: a
  callable that drops the last reference to itself while it runs (a profile hook calling
  ``sys.setprofile(None)``) reads what it needs first (``agent/_held.py``'s hook; as a
  closure it read freed cells).
- A class deriving from torch's ``Future`` and subclasses of ``dill.Pickler`` do not
  compile correctly (``agent/_futures.py``, ``serialization/_by_value.py`` stay Python).
  A value typed with a compiled class is checked against that class and the subclasses
  compiled with it, so an interpreted subclass is refused: what ``Future`` shares with the
  compiled ``CallResult`` is functions of a duck-typed future (``agent/_call_result.py``).
- The public facades (``actorrpc/_api.py``, ``autograd/_api.py``, RRefs) stay Python.
"""

from __future__ import annotations

import sys
from importlib.machinery import EXTENSION_SUFFIXES

__all__ = ["compiled_modules"]

# extension modules written by hand (not by mypyc: not part of what "compiled" reports):
# the streaming copy (C), built in every build where a compiler is present, and the
# native steps of distributed autograd and the tensor codec's (C++ against torch's
# headers), where the build can import torch
_HAND_WRITTEN = frozenset({
    "actorrpc.transport._streaming_copy",
    "actorrpc.autograd._native",
    "actorrpc.serialization._native_codec",
})


def compiled_modules() -> list[str]:
    """Names of the loaded ``actorrpc`` modules that run compiled: which build this
    process runs (an ``ACTORRPC_COMPILE=1`` install compiles the per-message path with
    mypyc; the pure-Python build has none). ``import actorrpc`` loads them all. The
    hand-written extensions (the streaming copy into shared memory, which every build
    has where a compiler was present; distributed autograd's native steps, which builds
    that can import torch have) are not counted.

    Example::

        >>> import actorrpc as rpc
        >>> rpc.compiled_modules()  # installed with ACTORRPC_COMPILE=1
        ['actorrpc.agent._agent', 'actorrpc.agent._batch_scheduling', ...]
        >>> rpc.compiled_modules()  # the pure-Python build
        []
    """
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith("actorrpc.")
        and name not in _HAND_WRITTEN
        and str(getattr(module, "__file__", "") or "").endswith(tuple(EXTENSION_SUFFIXES))
    )
