"""The PostgreSQL adapter (psycopg 3 or psycopg2)."""
