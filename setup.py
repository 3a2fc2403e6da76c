"""Metadata lives in setup.cfg; this file only ships ``hf_muon_autoregister.pth`` beside the package.

The .pth file is what makes ``--optim muon`` work in any Python process, including the child
processes a launcher starts (see ``hf_muon/_autoregister.py``); setup.cfg alone cannot install a
file at the top of site-packages. Both install kinds need it, by different routes:

* ``pip install .`` builds a wheel from ``build_lib``: ``build_py`` copies the file there.
* ``pip install -e .`` (PEP 660) builds an "editable" wheel that does not contain ``build_lib``'s
  files; setuptools' ``editable_wheel`` puts into that wheel whatever lies in its unpacked-wheel
  folder, so the file is copied there once the build commands ran.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "hf_muon_autoregister.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


commands = {"build_py": BuildPyWithPth}
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64 has no PEP 660 editable installs; `pip install -e .` then uses build_py
    editable_wheel = None

if editable_wheel is not None:

    class EditableWheelWithPth(editable_wheel):
        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            # everything in the unpacked-wheel folder lands in site-packages
            shutil.copy(os.path.join(HERE, PTH), os.path.join(unpacked_wheel, PTH))
            return result

    if not hasattr(editable_wheel, "_run_build_commands"):
        raise RuntimeError(
            "this setuptools has no editable_wheel._run_build_commands, so an editable install of hf_muon would "
            "miss hf_muon_autoregister.pth (and --optim muon from the command line). Use the setuptools "
            "hf_muon was tested with (84) or `pip install .` (not -e)."
        )
    commands["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=commands)
