pytest_plugins = ["tests.support.etcd_server"]
