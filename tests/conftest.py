pytest_plugins = ["tests.etcd_server"]
