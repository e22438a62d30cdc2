"""The ``omnicore`` command line. Importing it never imports torch (checked by a test)."""
