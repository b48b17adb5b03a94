"""Choosing: one search for advise and Watch, the options it chooses among, the policy it writes."""
