"""The file store with each write held `HICACHE_SLOW_WRITE_S` seconds before it lands: backups
still under way when a server is told to stop. Installed in a server's environment as a
backend (`tests.helpers.installed_backend`)."""
import os
import time

from hicache_async.storage.file import FileStorage


class SlowFileWrites(FileStorage):
    def batch_set_parts(self, keys, parts, ready=None):
        time.sleep(float(os.environ["HICACHE_SLOW_WRITE_S"]))
        return super().batch_set_parts(keys, parts, ready)
