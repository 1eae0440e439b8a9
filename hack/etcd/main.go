// Command etcd runs the etcd server for the local test control plane.
//
// etcd's own module cannot be installed with `go install` (its go.mod carries
// replace directives), so this wrapper module depends on it and calls its main.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
