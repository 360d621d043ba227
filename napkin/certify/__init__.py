"""Certificates of derivations and their independent checker: a certificate records a chain
of rule applications; the checker replays it with the rules alone (``checker``), each
certificate in a fresh process of its own (``isolate``)."""
