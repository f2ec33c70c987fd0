"""The Oracle adapter (python-oracledb, thin mode by default, or cx_Oracle)."""
