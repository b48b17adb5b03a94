"""The precision advisor: measure each module in each candidate precision, propose a policy."""
