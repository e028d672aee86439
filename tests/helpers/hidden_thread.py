"""Imported by a fork server under test: starts a thread that `threading` does not list (a
`_thread` one, as a native library's would be), so only the kernel's count can see it."""
import _thread
import time

_thread.start_new_thread(time.sleep, (3600,))
