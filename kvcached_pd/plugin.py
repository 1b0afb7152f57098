"""vLLM's ``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process.

vLLM runs general plugins in the API server (``EngineArgs``), in the EngineCore
(``EngineCore.__init__``, before it resolves the KV layout in 0.29+) and in each worker
(``WorkerWrapperBase.init_worker``), so this reaches every process that needs a patch,
spawned children included, with no step beyond ``pip install``.
"""

from __future__ import annotations


def register() -> None:
    from kvcached_pd.activation import activate

    activate()
