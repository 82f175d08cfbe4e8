"""mypy over the library's typed core, with the targets and settings of pyproject.toml's [tool.mypy].

    python tools/typecheck.py [MYPY OPTIONS]

mypy cannot follow pyproject's package-dir mapping (`reference/` is `flashmask3.reference`), so it
checks a link tree of the installed layout (package_tree.py) and the paths it prints are mapped back
to the checkout's. Its cache stays in build/, so later runs take a few seconds.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from package_tree import ROOT, build, package_dirs


def main(mypy_options: list[str]) -> int:
    # "flashmask3/reference/mask.py" -> "reference/mask.py": the deepest package first
    tree_to_checkout = sorted(
        ((package.replace(".", "/") + "/", folder + "/") for package, folder in package_dirs().items()),
        key=lambda pair: -len(pair[0]),
    )
    with tempfile.TemporaryDirectory() as tree:
        build(Path(tree))
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "--cache-dir",
                str(ROOT / "build" / "mypy_cache"),
                *mypy_options,
            ],
            cwd=tree,
            capture_output=True,
            text=True,
        )
    for line in result.stdout.splitlines():
        prefix = next((pair for pair in tree_to_checkout if line.startswith(pair[0])), None)
        print(prefix[1] + line[len(prefix[0]) :] if prefix else line)
    print(result.stderr, end="", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
