"""Imported first by the fork server of ``ckptd launch --preload`` (:mod:`ckptd.elastic.preloaded`), and
nowhere else: the server dies with the supervisor that started it (Linux ``PR_SET_PDEATHSIG``), and its
ranks die with it. Without this a SIGKILLed supervisor left the server and every rank running."""

from __future__ import annotations

from ckptd.elastic.preloaded import die_with_parent

die_with_parent()
