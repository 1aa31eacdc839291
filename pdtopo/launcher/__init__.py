"""Launcher: composed config -> plan -> run directory -> supervisord, plus status/stop/diff."""
