"""Code shared by the server and the nodes (no Flower app of its own)."""

from common.threads import quiet_waiting

quiet_waiting()  # before torch loads anywhere in a fedsyn process (common.threads says why)
