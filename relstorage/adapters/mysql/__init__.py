"""The MySQL / MariaDB adapter (InnoDB), for mysqlclient or PyMySQL."""
