"""Compile protos/aiserve/v1/*.proto into the aiserve.v1 package (the only generated code).

Run by `make protos` (and so by `make run` and `make test`). Never edit the output by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    proto_dir = ROOT / "protos"
    files = sorted(str(p) for p in (proto_dir / "aiserve" / "v1").glob("*.proto"))
    out = ROOT / "aiserve" / "v1"
    out.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *files,
    ]
    code = protoc.main(args)
    if code != 0:
        return code
    (out / "__init__.py").write_text('"""Generated from protos/aiserve/v1 by scripts/gen_protos.py."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
