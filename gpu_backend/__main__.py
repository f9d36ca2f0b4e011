"""``python -m gpu_backend [flags]``: see :mod:`gpu_backend.cli`; ``python -m gpu_backend model
pull|list ...``: see :mod:`gpu_backend.model_store`."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["model"]:
        from gpu_backend.model_store import main as model_main

        sys.exit(model_main(sys.argv[2:]))
    from gpu_backend.cli import main

    sys.exit(main())
