"""Reporting: the Advice and its values (with their JSON form), the table, the plot."""
