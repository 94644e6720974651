from localspec.cli.commands import entry

entry()
