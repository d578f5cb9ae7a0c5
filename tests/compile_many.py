"""Compile-only reports of several presets' training steps on N fake CPU devices, as JSON lines (one
process: a test's device count is fixed when JAX starts, so layouts of 64 devices run here).

    python tests/compile_many.py 64 '[["llama_70b", "fsdp=8,model=8", ["train.remat=full"]], ...]'
"""

import json
import sys

if __name__ == "__main__":
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from launch import configure

    for config, mesh, overrides in json.loads(sys.argv[2]):
        cfg, *_ = configure.configure(config, mesh, overrides)
        print(json.dumps(configure.compile_check(cfg)), flush=True)
