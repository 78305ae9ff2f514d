"""Build hook: ship ``sglang_session_cache.pth`` at the root of the wheel.

Everything else about the package is declared in pyproject.toml. The ``.pth``
file must land at the top of site-packages (not inside the package) so that
``site`` runs its ``import`` line at interpreter start-up; setuptools has no
declarative way to put a file there, so ``build_py`` copies it into the root
of ``build_lib``, which becomes the root of the wheel.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "sglang_session_cache.pth"
PTH_SOURCE = os.path.join("python", PTH_NAME)


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(PTH_SOURCE, os.path.join(self.build_lib, PTH_NAME), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs


setup(cmdclass={"build_py": build_py_with_pth})
