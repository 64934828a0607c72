"""rollstream.infra: the top of the stack, which nothing else imports.

cli.py        the ``rollstream`` console script (commands as data: flags.py)
logs.py       the one logging setup of every command (quiet console, ``-v``)
stack.py      the local stack: broker and topics (``up``, ``down``, ``status``)
kafka.py      the Kafka broker launcher (KRaft, jars resolved from Maven Central)
services.py   the supervisor of the demo's service processes (their logs go to files)
tail.py       ``rollstream tail``
configdoc.py  writes docs/configuration.md from the settings classes
demo/         ``rollstream demo`` and its agent
"""
