package main

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/store"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

func newConfigCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "config", Short: "Work with configuration files"}
	cmd.AddCommand(&cobra.Command{
		Use:   "validate FILE",
		Short: "Check a configuration file; name every bad key and value, exit non-zero if any",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := config.Load(args[0])
			if err != nil {
				return err
			}
			// The store's own parser reads the URL past its scheme.
			if err := store.CheckURL(c.Redis.URL); err != nil {
				var ue *redisstore.URLError
				if errors.As(err, &ue) {
					return fmt.Errorf("%s: redis.url = %q: %w", args[0], ue.URL, ue.Err)
				}
				return fmt.Errorf("%s: redis.url: not a usable Redis URL", args[0])
			}
			// A weak token in $server.admin_token_env stops `tether serve`.
			// Say so now. The error never shows the token.
			if _, err := c.Server.AdminToken(); err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			// The mode every request no rule matches is routed by, as
			// routing.mode, sticky_enabled and adaptive_sticky add up.
			p, err := plan.FromConfig(c, plan.Options{})
			if err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: ok (%d instances, mode %s)\n", args[0], len(p.Instances), p.Policy.Mode)
			return nil
		},
	})
	return cmd
}
