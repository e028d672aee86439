"""A process for the fork server's tests: says what it sees as one JSON line on stdout, echoes
stdin's first line to stderr, writes `ATEXIT_FILE` at interpreter exit and exits with its
first argument's code (or sleeps, with `sleep`)."""
import atexit
import json
import os
import sys
import time

if __name__ == "__main__":
    atexit.register(lambda: open(os.environ["ATEXIT_FILE"], "w").write("flushed"))
    print(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(),
                      "token": os.environ.get("WARM_TOKEN"), "name": __name__,
                      "warm": "xml.dom.minidom" in sys.modules}), flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.stderr.write(sys.stdin.readline())
    sys.exit(int(sys.argv[1]))
