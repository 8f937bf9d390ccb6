"""Compatibility alias: the MXFP4 reference moved beside its kernel (`engine.ops.mxfp4.reference`).

Kept only so branches written before the move merge without edits (to be removed after the merge);
import `engine.ops.mxfp4.reference` instead. This module sits on the weights floor, so the layers
and ops below it must not import it (tests/test_architecture.py fails if they do).
"""

import sys

from engine.ops.mxfp4 import reference as _reference

sys.modules[__name__] = _reference
