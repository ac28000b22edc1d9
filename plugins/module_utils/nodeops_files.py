# SPDX-License-Identifier: Apache-2.0
# -*- coding: utf-8 -*-
# Copyright: nodeops contributors
# Apache License 2.0 (see LICENSE)
"""Files the nodeops.cluster modules write on hosts: atomically (a temp file in the same
directory, then rename), so a reader never sees half a file and a failure leaves the old one."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import os
import tempfile


def atomic_write(path, data, mode):
    """Write bytes to path with the given mode (an int), replacing it in one rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".nodeops-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
