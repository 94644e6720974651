"""The `localspec` program: the click commands, the chat REPL, batch jobs from JSONL files and
`localspec check`. Thin layers over `localspec.runtime.engine.Engine`."""

from localspec.cli.commands import entry, main

__all__ = ["entry", "main"]
