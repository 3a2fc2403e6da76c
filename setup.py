"""Metadata lives in setup.cfg; this file only ships ``hf_muon_autoregister.pth`` beside the package.

The .pth file is what lets ``--optim muon`` reach child processes that a launcher starts (see
``hf_muon/integrations/import_hook.py``); setup.cfg alone cannot install a file at site-packages' top.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "hf_muon_autoregister.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):  # editable installs list outputs from here
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
