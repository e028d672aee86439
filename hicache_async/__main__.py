"""`python -m hicache_async` is the `hicache-async` command."""
from .app.cli import main

raise SystemExit(main())
