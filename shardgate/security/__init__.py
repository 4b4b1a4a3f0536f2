"""Security: users, roles and ACLs (`auth`) and the `shardgate users` commands (`users_cli`)."""
