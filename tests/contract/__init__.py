"""The backend contract suite: one set of cases that every worker backend passes."""
