"""Test machinery: helpers that start processes, the prestarted server, workers' inputs and the writers
of fixtures, imported by the tests, their conftest fixtures and bench/."""
