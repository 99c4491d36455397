"""The paged-KV LLM engine of one device: model, weights, KV cache, block manager, scheduler, step
composer, sampler and the device worker process. Import the modules themselves (`engine.llm_engine`,
`engine.config`, ...): this package's import loads nothing, so `import engine.capacity` stays light.

It only checks that `kernels` is this project's package, beside this one: Hugging Face's `kernels`
distribution (which transformers 5.25 and later require) has its import name, and where it comes first
on the path the engine's imports would fail on names it lacks. (Where ours comes first, `kernels`
refuses to import beside it: `kernels.refuse_namesake`.)"""

from importlib.util import find_spec as _find_spec
from pathlib import Path as _Path

_kernels = _find_spec("kernels")
_ours = _Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
if _kernels is None or _kernels.origin is None or _Path(_kernels.origin).resolve() != _ours:
    raise ImportError(f"the module kernels is {_kernels.origin if _kernels else None}, not cliffguard's ({_ours}): "
                      "Hugging Face's kernels distribution (which transformers 5.25 and later require) shares its "
                      "name. Uninstall it (pip uninstall kernels); cliffguard asks for transformers<5.25")
