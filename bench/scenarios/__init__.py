"""The bench's scenarios, one module per family: ``fleet``, ``storm``, ``hot_path``,
``celery_tasks``, ``many_accounts`` and ``sealing``; ``scenario`` is the shape they share
(``Scenario``, ``Result``, ``Goal``, ``Table``).

A scenario module imports ``harness`` (the servers, children and measuring tools),
``scenarios.scenario`` and the library; never the runner (``run.py``) nor another
scenario's module.
"""
