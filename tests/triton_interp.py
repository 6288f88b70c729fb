"""Triton's CPU interpreter, faster where it repeats itself (the kernel tests' worker processes).

Triton's interpreter (3.x, up to 3.9 at least) makes a call from one ``@triton.jit`` function to
another re-patch ``triton.language`` for the callee (``InterpretedFunction.__call__`` ->
``_patch_lang``): it walks every member of ``tl``, ``tl.tensor``, ``tl.math`` and ``tl.core`` looking
for builtins to wrap, ~0.3 ms, on every call. A module already patched has no builtin left to wrap,
so all but a launch's first such walk for a module set change nothing: the cost is the walk. The
fused step's kernels call small helpers many times a program (``rope_kv``: ~40 calls, 10 ms a
program), so the walk was three quarters of the interpreted whole-step tests' time.

``speed_up_device_calls()`` walks once per launch for each set of language modules a callee sees,
and skips the repeats: the same patches, in the same order, as the interpreter's own call. It
changes nothing the kernels compute (a builtin left unpatched raises, it never computes wrong),
and leaves the interpreter as it is if its internals are not the ones this was written against.
"""

from __future__ import annotations

_installed = False


def speed_up_device_calls() -> bool:
    """Install the skip in this process (idempotent); False where this Triton differs."""
    global _installed
    if _installed:
        return True
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    needed = (getattr(interp, "GridExecutor", None), getattr(interp, "InterpretedFunction", None),
              getattr(interp, "_patch_lang", None), getattr(interp, "InterpreterError", None))
    if any(n is None for n in needed) or not hasattr(interp.InterpretedFunction, "rewrite"):
        return False
    tl = interp.tl
    launch = {"patched": None}   # the module sets patched in the current launch (None: no launch)
    keys: dict = {}              # callee -> the language modules its globals hold

    def key(fn):
        k = keys.get(fn)
        if k is None:
            k = keys[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return k

    grid_call = interp.GridExecutor.__call__

    def run_grid(self, *args, **kwargs):
        outer, launch["patched"] = launch["patched"], set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch["patched"] = outer

    def call(self, *args, **kwargs):        # a device function call, as the interpreter's own
        patched, k = launch["patched"], key(self.fn)
        if patched is None or k not in patched:
            interp._patch_lang(self.fn)
            if patched is not None:
                patched.add(k)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.GridExecutor.__call__ = run_grid
    interp.InterpretedFunction.__call__ = call
    _installed = True
    return True
