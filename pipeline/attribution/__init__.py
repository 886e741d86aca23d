"""Attribution core: measured steps split exactly among requests, in integer nano-dollars.

Names are imported from their submodules; the package re-exports none, so each has one home.
"""
