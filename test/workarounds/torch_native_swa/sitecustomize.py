"""Test-only: apply the torch_native SWA-index workaround in every process of a
live test server (see test/workarounds/README.md)."""

import torch_native_swa_fix

torch_native_swa_fix.install_import_hook()
